"""Kimi Linear's released MLA convention ("NoPE" that keeps unrotated decoupled dims, latent-norm
eps 1e-6) and the KDA output-norm eps, each set from the config, against float64 NumPy
transcriptions of the published layers."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.config import ConfigError, base_config, validate
from kimijax.model import make_mixer

B, T, D, H = 2, 9, 32, 4


def np_rms(x, g, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g


def np_silu(x):
  return x / (1 + np.exp(-x))


def np_kimi_linear_mla(p, x, *, dn, dr, eps):
  """Kimi Linear's MLA with mla_use_nope: q = [q_nope ; q_pe] per head, k = [k_nope ; k_pe] with
  k_pe shared by all heads, no rotation of q_pe or k_pe, scale (dn + dr)^-0.5, causal softmax."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  c = np_rms(x @ p['kv_down'], p['kv_norm']['scale'], eps)
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
  cfg = _model_config(attention_kind='mla', mla_kv_lora_rank=12, mla_qk_nope_head_dim=dn,
                      mla_qk_rope_head_dim=dr, mla_rope=False, mla_latent_norm_eps=eps, norm_eps=1e-6)
  mixer = make_mixer(cfg, 'A', jnp.float32)
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  pos = jnp.broadcast_to(jnp.arange(T) + 100, (B, T))
  params = _init(mixer, x, pos)
  assert params['q_rope'].shape == (D, H, dr) and params['k_rope'].shape == (D, dr)
  y, _, _ = mixer.apply({'params': params}, x, pos)
  ref = np_kimi_linear_mla(params, np.asarray(x, np.float64), dn=dn, dr=dr, eps=eps)
  np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
  rotated = make_mixer(_model_config(attention_kind='mla', mla_kv_lora_rank=12, mla_qk_nope_head_dim=dn,
                                     mla_qk_rope_head_dim=dr, mla_latent_norm_eps=eps), 'A', jnp.float32)
  y_rot, _, _ = rotated.apply({'params': params}, x, pos)
  assert np.abs(np.asarray(y_rot) - ref).max() > 1e-3 * np.abs(ref).max()   # mla_rope=True does rotate


def test_mla_without_rotation_decodes_like_its_parallel_form():
  cfg = _model_config(attention_kind='mla', mla_kv_lora_rank=12, mla_qk_nope_head_dim=8,
                      mla_qk_rope_head_dim=4, mla_rope=False)
  mixer = make_mixer(cfg, 'A', jnp.float32)
  x = jax.random.normal(jax.random.key(2), (B, T, D))
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  params = _init(mixer, x, pos)
  y_full, _, _ = mixer.apply({'params': params}, x, pos)
  cache = type(mixer).init_cache(B, T, 12, 4, jnp.float32)
  y, _, cache = mixer.apply({'params': params}, x[:, :4], pos[:, :4], cache)
  outs = [y]
  for t in range(4, T):
    y, _, cache = mixer.apply({'params': params}, x[:, t:t + 1], pos[:, t:t + 1], cache)
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), y_full, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_full).max()))


def np_kda_layer_no_conv_no_gate(p, x, *, eps):
  """SPEC §1 without short conv and output gate; the per-head output RMSNorm with `eps`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  q, k, v = (np.einsum('btd,dhk->bthk', x, p[f'{n}_proj']) for n in 'qkv')
  l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
  q, k, v = l2(np_silu(q)), l2(np_silu(k)), np_silu(v)
  beta = 1 / (1 + np.exp(-np.einsum('btd,dh->bth', x, p['b_proj'])))
  f = np.einsum('btr,rhk->bthk', x @ p['f_a'], p['f_b']) + p['dt_bias']
  g = -np.exp(p['A_log'])[:, None] * np.log1p(np.exp(f))
  dk = q.shape[-1]
  s = np.zeros((x.shape[0], q.shape[2], dk, dk))
  o = np.zeros(q.shape)
  for t in range(x.shape[1]):
    s = s * np.exp(g[:, t])[..., None]
    pred = np.einsum('bhkv,bhk->bhv', s, k[:, t])
    s = s + np.einsum('bhk,bhv->bhkv', k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
    o[:, t] = np.einsum('bhkv,bhk->bhv', s, q[:, t] * dk ** -0.5)
  o = np_rms(o, p['o_norm'], eps)
  return np.einsum('bthk,hkd->btd', o, p['o_proj'])


def test_kda_output_norm_eps_comes_from_the_config():
  eps = 0.05     # large enough to change the output visibly against the old fixed 1e-5
  cfg = _model_config(kda_output_norm_eps=eps, kda_short_conv=False, kda_output_gate='none',
                      kda_impl='recurrent')
  mixer = make_mixer(cfg, 'K', jnp.float32)
  x = jax.random.normal(jax.random.key(3), (B, T, D))
  params = _init(mixer, x, None)
  y, _, _ = mixer.apply({'params': params}, x)
  ref = np_kda_layer_no_conv_no_gate(params, np.asarray(x, np.float64), eps=eps)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_kimi_linear_small_follows_the_released_mla_convention():
  from configs.kimi_linear_small import get_config
  m = get_config().model
  assert m.mla_qk_rope_head_dim > 0 and m.mla_rope is False
  assert m.mla_latent_norm_eps == 1e-6 and m.kda_output_norm_eps == m.norm_eps
  old = get_config('nope0').model       # the former 0-dim form stays available
  assert old.mla_qk_rope_head_dim == 0 and old.kda_output_norm_eps == 1e-5
  assert get_config('rope').model.mla_rope is True


@pytest.mark.parametrize('key,value,message', [
    ('mla_latent_norm_eps', 0.0, 'model.mla_latent_norm_eps=0.0 must be positive'),
    ('kda_output_norm_eps', -1.0, 'model.kda_output_norm_eps=-1.0 must be positive'),
])
def test_new_model_keys_are_validated(key, value, message):
  c = base_config()
  c.model[key] = value
  with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
    validate(c)
