"""Multi-head Latent Attention: a float64 NumPy transcription of the layer, and the absorbed
decode path against the parallel path token by token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.layers.mla import MultiHeadLatentAttention

B, T, D, H = 2, 11, 32, 4


def np_rms(x, g, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def np_rope(x, pos, theta):
  """x [..., T, ..., d] rotated by pairs (i, i + d/2) at angle pos * theta^(-2i/d); x [B,T,H,d]."""
  d = x.shape[-1]
  freq = theta ** (-np.arange(d // 2) * 2.0 / d)
  ang = pos[:, :, None, None] * freq
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def np_mla(p, x, pos, cfg):
  """float64 reference: returns y [B, T, D] and per-head max logits [H]."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  eps, dn, dr = 1e-6, cfg['qk_nope_head_dim'], cfg['qk_rope_head_dim']
  q_in = np_rms(x @ p['q_down'], p['q_norm']['scale'], eps) if cfg['q_lora_rank'] else x
  q = np.einsum('btr,rhk->bthk', q_in, p['q_nope'])
  c = np_rms(x @ p['kv_down'], p['kv_norm']['scale'], eps)
  k = np.einsum('btr,rhk->bthk', c, p['k_nope'])
  v = np.einsum('btr,rhk->bthk', c, p['v'])
  if dr:
    qr = np_rope(np.einsum('btr,rhk->bthk', q_in, p['q_rope']), pos, 10000.0)
    kr = np_rope((x @ p['k_rope'])[:, :, None], pos, 10000.0)
    q = np.concatenate([q, qr], -1)
    k = np.concatenate([k, np.broadcast_to(kr, k.shape[:3] + (dr,))], -1)
  logits = np.einsum('bthk,bshk->bhts', q, k) * (dn + dr) ** -0.5
  mask = np.tril(np.ones((x.shape[1], x.shape[1]), bool))
  logits = np.where(mask, logits, -np.inf)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  o = np.einsum('bhts,bshk->bthk', probs, v)
  return np.einsum('bthk,hkd->btd', o, p['out']), logits.max(axis=(0, 2, 3))


CASES = {
    'nope': dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8, q_lora_rank=0),
    'rope_qlora_dv': dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=10),
}


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


@pytest.mark.parametrize('cfg', CASES.values(), ids=CASES.keys())
def test_prefill_then_decode_equals_parallel(cfg):
  layer, params, x, pos = _layer_and_params(cfg)
  y_full, _, _ = layer.apply({'params': params}, x, pos)
  prompt, max_len = 5, T + 3
  cache = MultiHeadLatentAttention.init_cache(B, max_len, cfg['kv_lora_rank'], cfg['qk_rope_head_dim'],
                                              jnp.float32)
  y, _, cache = layer.apply({'params': params}, x[:, :prompt], pos[:, :prompt], cache)
  outs = [y]
  for t in range(prompt, T):
    y, max_logits, cache = layer.apply({'params': params}, x[:, t:t + 1], pos[:, t:t + 1], cache)
    assert max_logits is None
    outs.append(y)
  assert cache['latent'].shape == (B, max_len, cfg['kv_lora_rank'])
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), y_full, rtol=1e-4,
                             atol=1e-5 * float(jnp.abs(y_full).max()))
