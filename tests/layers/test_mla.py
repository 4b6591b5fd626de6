"""Multi-head Latent Attention: a float64 NumPy transcription of the layer (tests/oracles.py), and
the absorbed decode path against the parallel path token by token; Kimi Linear's released MLA
convention ("NoPE" that keeps unrotated decoupled dims, latent-norm eps 1e-6), set from the config,
against a float64 transcription of the published layer."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import np_mla, np_rmsnorm

from kimijax.config import ConfigError, base_config, validate
from kimijax.layers.mla import MultiHeadLatentAttention
from kimijax.model import make_mixer

B, T, D, H = 2, 11, 32, 4


CASES = {
  'nope': dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8, q_lora_rank=0),
  'rope_qlora_dv': dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=10),
  'rope_r32': dict(kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16, v_head_dim=8, q_lora_rank=0),
}
# The decode implementations (kimijax/ops/mla_decode.py; 'pallas' interpreted here) on the cases whose
# latent dims the kernel takes (r and dr powers of two >= 16, or dr = 0).
DECODE = [
  pytest.param(CASES[name], impl, id=f'{name}-{impl}')
  for name in CASES
  for impl in ('xla', 'pallas')
  if impl == 'xla' or name != 'rope_qlora_dv'
]


def _layer_and_params(cfg):
  layer = MultiHeadLatentAttention(H, init_std=0.3, **cfg)
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  params = jax.tree.map(lambda a: a, layer.init(jax.random.key(0), x, pos)['params'])
  from flax import linen as nn

  return layer, nn.unbox(params), x, pos


@pytest.mark.parametrize('cfg', CASES.values(), ids=CASES.keys())
def test_forward_matches_numpy(cfg):
  layer, params, x, pos = _layer_and_params(cfg)
  y, max_logits, cache = layer.apply({'params': params}, x, pos)
  ref_y, ref_max = np_mla(params, np.asarray(x, np.float64), np.asarray(pos, np.float64), cfg)
  assert cache is None
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-5 * np.abs(ref_y).max())
  np.testing.assert_allclose(max_logits, ref_max, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('cfg,impl', DECODE)
def test_prefill_then_decode_equals_parallel(cfg, impl):
  layer, params, x, pos = _layer_and_params(cfg)
  y_full, _, _ = layer.apply({'params': params}, x, pos)
  layer = layer.clone(decode_impl=impl)
  prompt, max_len = 5, T + 3
  cache = MultiHeadLatentAttention.init_cache(B, max_len, cfg['kv_lora_rank'], cfg['qk_rope_head_dim'], jnp.float32)
  y, _, cache = layer.apply({'params': params}, x[:, :prompt], pos[:, :prompt], cache)
  outs = [y]
  for t in range(prompt, T):
    y, max_logits, cache = layer.apply({'params': params}, x[:, t : t + 1], pos[:, t : t + 1], cache)
    assert max_logits is None
    outs.append(y)
  assert cache['latent'].shape == (B, max_len, cfg['kv_lora_rank'])
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), y_full, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_full).max()))


# ----------------------------------------------------------------------------- Kimi Linear's MLA convention


T_KL = 9


def np_kimi_linear_mla(p, x, *, dn, dr, eps):
  """Kimi Linear's MLA with mla_use_nope: q = [q_nope ; q_pe] per head, k = [k_nope ; k_pe] with
  k_pe shared by all heads, no rotation of q_pe or k_pe, scale (dn + dr)^-0.5, causal softmax."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  c = np_rmsnorm(x @ p['kv_down'], p['kv_norm']['scale'], eps)
  q = np.concatenate([np.einsum('btd,dhk->bthk', x, p['q_nope']), np.einsum('btd,dhk->bthk', x, p['q_rope'])], -1)
  k_nope = np.einsum('btr,rhk->bthk', c, p['k_nope'])
  k_pe = np.broadcast_to((x @ p['k_rope'])[:, :, None], k_nope.shape[:3] + (dr,))
  k = np.concatenate([k_nope, k_pe], -1)
  v = np.einsum('btr,rhk->bthk', c, p['v'])
  logits = np.einsum('bthk,bshk->bhts', q, k) * (dn + dr) ** -0.5
  logits = np.where(np.tril(np.ones((x.shape[1],) * 2, bool)), logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  return np.einsum('bthk,hkd->btd', np.einsum('bhts,bshk->bthk', probs, v), p['out'])


def _model_config(**model):
  c = base_config()
  c.model.d_model, c.model.num_heads, c.model.init_std, c.model.compute_dtype = D, H, 0.3, 'float32'
  for k, v in model.items():
    c.model[k] = v
  return validate(c).model


def _init(mixer, x, pos):
  return nn.unbox(mixer.init(jax.random.key(0), x, pos)['params'])


def test_mla_decoupled_dims_without_rotation_match_kimi_linear():
  """mla_rope=False keeps the decoupled dims and does not rotate them, with real positions; the
  latent norm uses model.mla_latent_norm_eps, not model.norm_eps."""
  dn, dr, eps = 8, 4, 1e-2
  cfg = _model_config(
    attention_kind='mla',
    mla_kv_lora_rank=12,
    mla_qk_nope_head_dim=dn,
    mla_qk_rope_head_dim=dr,
    mla_rope=False,
    mla_latent_norm_eps=eps,
    norm_eps=1e-6,
  )
  mixer = make_mixer(cfg, 'A', jnp.float32)
  x = jax.random.normal(jax.random.key(1), (B, T_KL, D))
  pos = jnp.broadcast_to(jnp.arange(T_KL) + 100, (B, T_KL))
  params = _init(mixer, x, pos)
  assert params['q_rope'].shape == (D, H, dr) and params['k_rope'].shape == (D, dr)
  y, _, _ = mixer.apply({'params': params}, x, pos)
  ref = np_kimi_linear_mla(params, np.asarray(x, np.float64), dn=dn, dr=dr, eps=eps)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  rotated = make_mixer(
    _model_config(
      attention_kind='mla',
      mla_kv_lora_rank=12,
      mla_qk_nope_head_dim=dn,
      mla_qk_rope_head_dim=dr,
      mla_latent_norm_eps=eps,
    ),
    'A',
    jnp.float32,
  )
  y_rot, _, _ = rotated.apply({'params': params}, x, pos)
  assert np.abs(np.asarray(y_rot) - ref).max() > 1e-3 * np.abs(ref).max()  # mla_rope=True does rotate


def test_mla_without_rotation_decodes_like_its_parallel_form():
  cfg = _model_config(
    attention_kind='mla', mla_kv_lora_rank=12, mla_qk_nope_head_dim=8, mla_qk_rope_head_dim=4, mla_rope=False
  )
  mixer = make_mixer(cfg, 'A', jnp.float32)
  x = jax.random.normal(jax.random.key(2), (B, T_KL, D))
  pos = jnp.broadcast_to(jnp.arange(T_KL), (B, T_KL))
  params = _init(mixer, x, pos)
  y_full, _, _ = mixer.apply({'params': params}, x, pos)
  cache = type(mixer).init_cache(B, T_KL, 12, 4, jnp.float32)
  y, _, cache = mixer.apply({'params': params}, x[:, :4], pos[:, :4], cache)
  outs = [y]
  for t in range(4, T_KL):
    y, _, cache = mixer.apply({'params': params}, x[:, t : t + 1], pos[:, t : t + 1], cache)
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), y_full, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_full).max()))


def test_kimi_linear_small_follows_the_released_mla_convention():
  from configs.kimi_linear_small import get_config

  m = get_config().model
  assert m.mla_qk_rope_head_dim > 0 and m.mla_rope is False
  assert m.mla_latent_norm_eps == 1e-6 and m.kda_output_norm_eps == m.norm_eps
  old = get_config('nope0').model  # the former 0-dim form stays available
  assert old.mla_qk_rope_head_dim == 0 and old.kda_output_norm_eps == 1e-5
  assert get_config('rope').model.mla_rope is True


def test_latent_norm_eps_is_validated():
  c = base_config()
  c.model.mla_latent_norm_eps = 0.0
  with pytest.raises(ConfigError, match=r'model.mla_latent_norm_eps=0.0 must be positive'):
    validate(c)
