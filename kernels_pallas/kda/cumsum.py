"""Within-chunk cumulative sums of [B, T, H, K] float32 tensors (SPEC §1: G = cumsum of g per chunk).

One program per (batch, head, chunk) holds the chunk's [C, K] block. The inclusive sum (G from g,
forward) is a scan down the block's rows; the reverse inclusive sum (dg from dG, backward; the
Triton backend has no reverse scan) multiplies the block by the [C, C] upper triangle of ones in
a full-precision float32 dot. Either way one read and one write of the tensor: XLA's cumulative
sum over the chunk axis took about 5x that time on an H200 (experiments/results/bench_kda.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kernels_pallas.kda.blocks import F32, dot


def chunk_cumsum_kernel(x_ref, o_ref, *, reverse):
  x = x_ref[...].astype(F32)
  if not reverse:
    o_ref[...] = jnp.cumsum(x, axis=0)
    return
  c = x.shape[0]
  upper = (jax.lax.broadcasted_iota(jnp.int32, (c, c), 1) >= jax.lax.broadcasted_iota(jnp.int32, (c, c), 0))
  o_ref[...] = dot(upper.astype(F32), x)
