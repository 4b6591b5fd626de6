"""Within-chunk cumulative sums of [B, T, H, K] float32 tensors (SPEC §1: G = cumsum of g per chunk).

One program per (batch, head, chunk) holds the chunk's [C, K] block. The inclusive sum (G from g,
forward) is a scan down the block's rows. The reverse inclusive sum (dg from dG, backward; the
Triton backend has no reverse scan) multiplies the block by the [C, C] upper triangle of ones on
the tensor cores: the ones are exact in bf16 and the block is split into three bf16 parts whose
sum is the float32 value, so three bf16 dots with float32 accumulation give the float32 sums (a
float32 "IEEE" dot runs on the FMA units, about 5x slower here), and adds a per-chunk row (the
gradient of the chunk's total decay, which every g of the chunk receives). Either way one read
and one write of the tensor; XLA's cumulative sum over the chunk axis took about 2x the forward's and
the FMA dot 5x (experiments/results/bench_kda.md).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.kda.blocks import F32, dot, iotas


def chunk_cumsum_kernel(x_ref, *refs, reverse):
  """refs: (o_ref,), or with reverse (add_ref, o_ref): add [K] added to every row of the result."""
  *add_ref, o_ref = refs
  x = x_ref[...].astype(F32)
  if not reverse:
    o_ref[...] = jnp.cumsum(x, axis=0)
    return
  r, j = iotas(x.shape[0])
  upper = (j >= r).astype(jnp.bfloat16)
  total = jnp.zeros(x.shape, F32)
  for _ in range(3):                      # x = x_1 + x_2 + x_3 + O(2^-24 |x|), each x_i in bf16
    part = x.astype(jnp.bfloat16)
    total += dot(upper, part)
    x = x - part.astype(F32)
  o_ref[...] = total + add_ref[0][...][None, :] if add_ref else total
