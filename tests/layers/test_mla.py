"""Multi-head Latent Attention: a float64 NumPy transcription of the layer (tests/oracles.py), and
the absorbed decode path against the parallel path token by token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.layers.mla import MultiHeadLatentAttention

from oracles import np_mla

B, T, D, H = 2, 11, 32, 4


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
