"""Exact per-head max attention logit (docs/optimizers.md#qk-clip) as one fused Pallas (Triton) kernel.

The fused cuDNN attention does not expose its logits, so QK-Clip's S_max^h needs its own pass.
This kernel streams key blocks past a resident query block, keeps a running row max of
scale * q.k in float32 registers and skips key blocks that lie wholly above the causal diagonal,
so it never writes a [T, S] logit matrix to memory: about half the FLOPs of one QK^T and
O(B*H*T) memory traffic. Output per (batch, head, query row); the caller reduces.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import triton_params


def _kernel(q_ref, k_ref, o_ref, *, scale, block_q, block_k, t, s, causal):
  i = pl.program_id(2)
  offset = s - t  # queries are the last t of s positions
  q = q_ref[...]  # [block_q, D]
  rows = i * block_q + jnp.arange(block_q)
  row_valid = rows < t

  def body(j, running_max):
    k = k_ref[pl.ds(j * block_k, block_k), :]  # [block_k, D]
    logits = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
    cols = j * block_k + jnp.arange(block_k)
    valid = row_valid[:, None] & (cols < s)[None, :]
    if causal:
      valid &= rows[:, None] + offset >= cols[None, :]
    return jnp.maximum(running_max, jnp.max(jnp.where(valid, logits, -jnp.inf), axis=1))

  n_k = pl.cdiv(s, block_k)
  if causal:
    n_k = jnp.minimum(n_k, pl.cdiv((i + 1) * block_q + offset, block_k))
  o_ref[...] = jax.lax.fori_loop(0, n_k, body, jnp.full((block_q,), -jnp.inf, jnp.float32))


@functools.partial(
  jax.jit, static_argnames=('causal', 'scale', 'block_q', 'block_k', 'num_warps', 'num_stages', 'interpret')
)
def max_logits(q, k, *, causal=True, scale=None, block_q=128, block_k=64, num_warps=4, num_stages=2, interpret=False):
  """q [B, T, H, D], k [B, S, Hkv, D] -> [H] float32, the max over batch, queries and unmasked
  keys of scale * q . k (queries are the last T of the S positions). No gradient."""
  b, t, h, d = q.shape
  s, hkv = k.shape[1], k.shape[2]
  group = h // hkv
  scale = d**-0.5 if scale is None else scale
  q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
  block_q, block_k = min(block_q, pl.next_power_of_2(t)), min(block_k, pl.next_power_of_2(s))
  t_pad, s_pad = pl.cdiv(t, block_q) * block_q, pl.cdiv(s, block_k) * block_k
  d_pad = max(pl.next_power_of_2(d), 16)
  q = jnp.pad(q, ((0, 0), (0, t_pad - t), (0, 0), (0, d_pad - d)))
  k = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, d_pad - d)))
  kernel = functools.partial(_kernel, scale=scale, block_q=block_q, block_k=block_k, t=t, s=s, causal=causal)
  rows_max = pl.pallas_call(
    kernel,
    grid=(b, h, t_pad // block_q),
    in_specs=[
      pl.BlockSpec((None, block_q, None, d_pad), lambda bi, hi, qi: (bi, qi, hi, 0)),
      pl.BlockSpec((None, s_pad, None, d_pad), lambda bi, hi, qi: (bi, 0, hi // group, 0)),
    ],
    out_specs=pl.BlockSpec((None, None, block_q), lambda bi, hi, qi: (bi, hi, qi)),
    out_shape=jax.ShapeDtypeStruct((b, h, t_pad), jnp.float32),
    compiler_params=triton_params(num_warps, num_stages),
    interpret=interpret,
    name='attention_max_logits',
  )(q, k)
  return jnp.max(rows_max, axis=(0, 2))
