"""Multi-head Latent Attention (DeepSeek-V2 style, as used by Kimi Linear's full-attention layers).

    c = RMSNorm(W_dkv x)                      [r]     the compressed KV latent (cached at decode)
    k_h = [W_uk_h c ; RoPE(W_kr x)]                   per-head no-position part, shared rotary part
    v_h = W_uv_h c
    q_h = [W_uq_h cq ; RoPE(W_qr_h cq)],  cq = RMSNorm(W_dq x) (or cq = x without a q low rank)
    y = W_o [softmax(scale q_h . k_h) v_h]_h,  scale = (d_nope + d_rope) ** -0.5 (x YaRN's multiplier, if set)

The decoupled dims (qk_rope_head_dim > 0: a per-head query part W_qr_h cq and a key part W_kr x
shared by all heads) are rotated with RoPE when `rope` is True. With rope=False they are kept and
not rotated: Kimi Linear's released MLA ("NoPE", mla_use_nope) is this form, with 64 such dims.
qk_rope_head_dim = 0 is NoPE without decoupled dims. The no-position and decoupled parts are
separate parameters (q_nope / q_rope, k_nope, shared k_rope) so QK-Clip can scale them
differently (docs/optimizers.md#qk-clip); Muon orthogonalises them as DeepSeek-V3's fused matrices by default
(kimijax.optim.routing). The latent norms (q_norm, kv_norm) use norm_eps (1e-6 in the release).
Decoding uses the absorbed form: queries are mapped into the latent
space (W_uk_h^T q_h) and attend over the cached latents like multi-query attention
(kimijax.ops.mla_decode, by decode_impl); the cache holds r + d_rope numbers per token instead of 2 H D.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.layers.norms import RMSNorm
from kimijax.layers.params import weight
from kimijax.layers.rope import Yarn, apply_rope, softmax_scale
from kimijax.ops.attention import attention
from kimijax.ops.mla_decode import mla_decode


def _write(buffer_bs, x_bt, start):
  """buffer [B, S, ...] with x [B, T, ...] written at positions start .. start+T-1."""
  return jax.lax.dynamic_update_slice_in_dim(buffer_bs, x_bt.astype(buffer_bs.dtype), start, axis=1)


class MultiHeadLatentAttention(nn.Module):
  """x [B, T, D] -> (y [B, T, D], max_logits [H] fp32 or None, cache or None). max_logits is None
  when decoding and when `max_logits` is False (then nothing computes them).

  Training and prefill attend in full form: q and k have qk_nope_head_dim + qk_rope_head_dim
  dims per head and v has v_head_dim (192 and 128 in Kimi Linear); an implementation that needs
  one head dim pads v itself (ops.attention's 'cudnn'), so this layer never pads. With
  segment_ids_bt [B, T] (packed documents, data.document_mask; training only) a query attends only
  within its document; positions_bt restart at each document for the rotated dims."""

  num_heads: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int = 0  # decoupled dims (query per head, key shared)
  v_head_dim: int = 0  # 0: qk_nope_head_dim
  q_lora_rank: int = 0  # 0: full-rank queries
  rope_theta: float = 10000.0
  impl: str = 'xla'
  norm_eps: float = 1e-6  # the latent norms' eps
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  rope: bool = True  # rotate the decoupled dims; False: keep them unrotated
  max_logits: bool = True  # return the per-head max logits in training (docs/optimizers.md#qk-clip)
  decode_impl: str = 'xla'  # decoding's attention over the latents (kimijax/ops/mla_decode.py IMPLS)
  decode_settings: Any = None  # the settings of decode_impl's kernels (None: the defaults)
  yarn: Yarn | None = None  # YaRN's context extension of the decoupled dims' RoPE (kimijax/layers/rope.py)

  @nn.compact
  def __call__(self, x_btd, positions_bt, cache=None, segment_ids_bt=None):
    h, dn, dr, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
    dv = self.v_head_dim or dn
    d = x_btd.shape[-1]
    x_btd = x_btd.astype(self.dtype)
    scale = softmax_scale(dn + dr, self.yarn if self.rope and dr else None)

    if self.q_lora_rank:
      cq_btr = jnp.einsum('btd,dr->btr', x_btd, weight(self, 'q_down', (d, self.q_lora_rank), ('embed', 'latent')))
      cq_btr = RMSNorm(eps=self.norm_eps, dtype=self.dtype, name='q_norm')(cq_btr)
      q_in, q_axes = cq_btr, ('latent', 'heads', 'head_dim')
    else:
      q_in, q_axes = x_btd, ('embed', 'heads', 'head_dim')
    q_nope_bthk = jnp.einsum('btr,rhk->bthk', q_in, weight(self, 'q_nope', (q_in.shape[-1], h, dn), q_axes))
    c_btr = jnp.einsum('btd,dr->btr', x_btd, weight(self, 'kv_down', (d, r), ('embed', 'latent')))
    c_btr = RMSNorm(eps=self.norm_eps, dtype=self.dtype, name='kv_norm')(c_btr)
    w_k_nope = weight(self, 'k_nope', (r, h, dn), ('latent', 'heads', 'head_dim'))
    w_v = weight(self, 'v', (r, h, dv), ('latent', 'heads', 'head_dim'))
    w_o = weight(self, 'out', (h, dv, d), ('heads', 'head_dim', 'embed'))
    if dr:
      q_rope_bthk = jnp.einsum('btr,rhk->bthk', q_in, weight(self, 'q_rope', (q_in.shape[-1], h, dr), q_axes))
      k_rope_btk = jnp.einsum('btd,dk->btk', x_btd, weight(self, 'k_rope', (d, dr), ('embed', 'head_dim')))
      if self.rope:
        q_rope_bthk = apply_rope(q_rope_bthk, positions_bt, self.rope_theta, self.yarn)
        k_rope_btk = apply_rope(k_rope_btk[:, :, None], positions_bt, self.rope_theta, self.yarn)[:, :, 0]  # [B, T, dr]

    new_cache = None
    if cache is not None and x_btd.shape[1] == 1:
      o_bthv, new_cache = self._decode(
        q_nope_bthk,
        q_rope_bthk if dr else None,
        c_btr,
        k_rope_btk if dr else None,
        w_k_nope,
        w_v,
        cache,
        positions_bt[0, 0],
        scale,
      )
      return jnp.einsum('bthk,hkd->btd', o_bthv, w_o), None, new_cache
    if cache is not None:  # prefill from an empty cache: write the latents, attend in full form
      new_cache = {'latent': _write(cache['latent'], c_btr, 0)}
      if dr:
        new_cache['k_rope'] = _write(cache['k_rope'], k_rope_btk, 0)

    k_nope_bthk = jnp.einsum('btr,rhk->bthk', c_btr, w_k_nope)
    v_bthv = jnp.einsum('btr,rhk->bthk', c_btr, w_v)
    if dr:
      q_bthk = jnp.concatenate([q_nope_bthk, q_rope_bthk], axis=-1)
      k_shared = jnp.broadcast_to(k_rope_btk[:, :, None], k_nope_bthk.shape[:3] + (dr,))  # one per head
      k_bthk = jnp.concatenate([k_nope_bthk, k_shared], axis=-1)
    else:
      q_bthk, k_bthk = q_nope_bthk, k_nope_bthk
    act = ('act_batch', 'act_length', 'act_heads', None)
    q_bthk, k_bthk, v_bthv = (nn.with_logical_constraint(t, act) for t in (q_bthk, k_bthk, v_bthv))
    result = attention(
      q_bthk,
      k_bthk,
      v_bthv,
      causal=True,
      impl=self.impl,
      scale=scale,
      return_max_logits=self.max_logits,
      spec=nn.logical_to_mesh_axes(act),
      segment_ids=segment_ids_bt,
    )
    o_bthv, max_logits_h = result if self.max_logits else (result, None)
    return jnp.einsum('bthk,hkd->btd', o_bthv, w_o), max_logits_h, new_cache

  def _decode(self, q_nope_bthk, q_rope_bthk, c_btr, k_rope_btk, w_k_nope, w_v, cache, pos, scale):
    """One token at position `pos` against the cached latents (absorbed, MQA-like form; the attention
    over the latents is kimijax.ops.mla_decode, by decode_impl)."""
    latent = _write(cache['latent'], c_btr, pos)
    new_cache = {'latent': latent}
    q_latent_bhr = jnp.einsum('bthk,rhk->bhr', q_nope_bthk, w_k_nope)  # T = 1
    q_rope_bhk = rope = None
    if q_rope_bthk is not None:
      rope = new_cache['k_rope'] = _write(cache['k_rope'], k_rope_btk, pos)
      q_rope_bhk = q_rope_bthk[:, 0]
    o_latent_bhr = mla_decode(
      q_latent_bhr, q_rope_bhk, latent, rope, pos + 1, scale=scale, impl=self.decode_impl, settings=self.decode_settings
    )
    return jnp.einsum('bhr,rhk->bhk', o_latent_bhr, w_v)[:, None], new_cache

  @staticmethod
  def init_cache(batch: int, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype) -> dict:
    cache = {'latent': jnp.zeros((batch, max_len, kv_lora_rank), dtype)}
    if qk_rope_head_dim:
      cache['k_rope'] = jnp.zeros((batch, max_len, qk_rope_head_dim), dtype)
    return cache
