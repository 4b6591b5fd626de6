"""Multi-head / grouped-query self-attention with RoPE or NoPE."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.layers.params import project, weight
from kimijax.layers.rope import Yarn, apply_rope, softmax_scale
from kimijax.ops.attention import attention, decode_attention


class SelfAttention(nn.Module):
  """Causal self-attention. x [B, T, D] -> (y [B, T, D], max_logits [H] fp32, cache).

  Without a cache: training, max logits returned (None when `max_logits` is False: nothing
  computes them), cache None; with segment_ids_bt [B, T] (packed documents, data.document_mask) a
  query attends only within its document, and positions_bt restart at each document (RoPE). With
  a cache {'k', 'v'} [B, S_max, Hkv, Dh]: a prefill from position 0 (T tokens) or a decode step
  (T = 1); the keys and values are written at positions_bt[0] onwards and max_logits is None.

  Query kernel [D, H, Dh], key/value kernels [D, Hkv, Dh], output kernel [H, Dh, D], so that
  per-head weight rewrites (QK-Clip, docs/optimizers.md#qk-clip) index the head axis directly.
  """

  num_heads: int
  num_kv_heads: int
  rope: bool
  rope_theta: float
  impl: str
  init_std: float
  dtype: jnp.dtype = jnp.float32
  max_logits: bool = True  # return the per-head max logits in training (docs/optimizers.md#qk-clip)
  yarn: Yarn | None = None  # YaRN's context extension of RoPE (kimijax/layers/rope.py)

  @nn.compact
  def __call__(self, x_btd, positions_bt, cache=None, segment_ids_bt=None):
    d = x_btd.shape[-1]
    head_dim = d // self.num_heads
    scale = softmax_scale(head_dim, self.yarn if self.rope else None)
    x_btd = x_btd.astype(self.dtype)
    w_q = weight(self, 'query', (d, self.num_heads, head_dim), ('embed', 'heads', 'head_dim'))
    w_k = weight(self, 'key', (d, self.num_kv_heads, head_dim), ('embed', 'kv_heads', 'head_dim'))
    w_v = weight(self, 'value', (d, self.num_kv_heads, head_dim), ('embed', 'kv_heads', 'head_dim'))
    w_o = weight(self, 'out', (self.num_heads, head_dim, d), ('heads', 'head_dim', 'embed'))
    if self.num_kv_heads == self.num_heads:
      q_bthd, k_bthd, v_bthd = project(x_btd, w_q, w_k, w_v)
    else:
      q_bthd, k_bthd, v_bthd = (jnp.einsum('btd,dhk->bthk', x_btd, w) for w in (w_q, w_k, w_v))
    if self.rope:
      q_bthd = apply_rope(q_bthd, positions_bt, self.rope_theta, self.yarn)
      k_bthd = apply_rope(k_bthd, positions_bt, self.rope_theta, self.yarn)
    names = ('act_batch', 'act_length', 'act_heads', None)
    q_bthd, k_bthd, v_bthd = (nn.with_logical_constraint(t, names) for t in (q_bthd, k_bthd, v_bthd))
    if cache is None:
      result = attention(
        q_bthd,
        k_bthd,
        v_bthd,
        causal=True,
        impl=self.impl,
        scale=scale,
        return_max_logits=self.max_logits,
        spec=nn.logical_to_mesh_axes(names),
        segment_ids=segment_ids_bt,
      )
      o_bthd, max_logits_h = result if self.max_logits else (result, None)
      new_cache = None
    else:  # write this call's keys/values at their positions; prefill starts at position 0
      start = positions_bt[0, 0]
      new_cache = {
        name: jax.lax.dynamic_update_slice_in_dim(cache[name], t.astype(cache[name].dtype), start, axis=1)
        for name, t in (('k', k_bthd), ('v', v_bthd))
      }
      if x_btd.shape[1] == 1:
        o_bthd = decode_attention(q_bthd, new_cache['k'], new_cache['v'], start + 1, scale=scale)
      else:
        o_bthd = attention(q_bthd, k_bthd, v_bthd, causal=True, impl=self.impl, scale=scale)
      max_logits_h = None
    o_bthd = nn.with_logical_constraint(o_bthd, names)
    return jnp.einsum('bthk,hkd->btd', o_bthd, w_o), max_logits_h, new_cache
