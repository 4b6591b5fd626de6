"""Per-layer decode caches, built from the model config.

    attention ('A', mha/gqa):  k, v           [B, S_max, Hkv, Dh]  (compute dtype)
    attention ('A', mla):      latent         [B, S_max, kv_lora_rank] (+ k_rope [B, S_max, d_rope])
    Kimi Delta Attention ('K'): state         [B, H, K, V] float32, and conv_q/k/v [B, 3, H, K]
The KDA entries do not grow with the context: that is the point of the hybrid stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib
from kimijax.layers.kda import KimiDeltaAttention
from kimijax.layers.mla import MultiHeadLatentAttention


def init_cache(m: ml_collections.ConfigDict, batch: int, max_len: int) -> dict:
  """{'layer_<i>': that layer's empty cache} for sequences of up to max_len tokens."""
  dtype = jnp.dtype(m.compute_dtype)
  cache = {}
  for i, kind in enumerate(config_lib.layer_kinds(m)):
    if kind == 'K':
      heads, head_dim = config_lib.kda_dims(m)
      cache[f'layer_{i}'] = KimiDeltaAttention.init_cache(batch, heads, head_dim, m.kda_short_conv, dtype)
    elif m.attention_kind == 'mla':
      cache[f'layer_{i}'] = MultiHeadLatentAttention.init_cache(
        batch, max_len, m.mla_kv_lora_rank, m.mla_qk_rope_head_dim, dtype
      )
    else:
      shape = (batch, max_len, config_lib.num_kv_heads(m), m.d_model // m.num_heads)
      cache[f'layer_{i}'] = {'k': jnp.zeros(shape, dtype), 'v': jnp.zeros(shape, dtype)}
  return cache


def cache_bytes(cache: dict) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))
