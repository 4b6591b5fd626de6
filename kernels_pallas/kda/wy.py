"""KDA's UT transform inside a chunk (docs/kda.md): W = T Diag(beta) (exp(G) k), U = T Diag(beta) v with
T = (I + N)^-1, N = Diag(beta) A_kk strictly lower-triangular (from scores.py).

wy_inverse_kernel: one program per chunk forms T's 16 x 16 blocks from products of 16 x 16
blocks in float32 with full-precision dots (blocks.inverse_blocks) and writes T in the dot
dtype, the dtype every later product reads it in. wy_apply_kernel: one program per chunk
applies T on the tensor cores (dot dtype operands, float32 accumulation) for W and U and writes
the chunk's direct terms qg = scale q exp(G) and kg = k exp(G_C - G); the backward reruns it
from the saved T (its transpose is cotangents.wy_bwd_kernel).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.blocks import F32, dot, inverse_blocks, rows


def wy_inverse_kernel(n_ref, t_ref, *, nb):
  t = inverse_blocks([[n_ref[rows(a), rows(b)] if b <= a else None for b in range(nb)] for a in range(nb)], nb)
  for a in range(nb):
    for b in range(nb):
      t_ref[rows(a), rows(b)] = (t[a][b] if b <= a else jnp.zeros_like(t[a][a])).astype(t_ref.dtype)


def wy_apply_kernel(t_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, qg_ref, kg_ref, w_ref, u_ref, *, scale, dot_dtype):
  c = g_ref.shape[0]
  g = g_ref[...]
  eg = jnp.exp(g)
  k = k_ref[...].astype(F32)
  beta = beta_ref[...].astype(F32)[:, None]
  qg_ref[...] = (scale * q_ref[...].astype(F32) * eg).astype(qg_ref.dtype)
  kg_ref[...] = (k * jnp.exp(g_ref[pl.ds(c - 1, 1), :] - g)).astype(kg_ref.dtype)
  t = t_ref[...].astype(dot_dtype)
  w_ref[...] = dot(t, (beta * eg * k).astype(dot_dtype)).astype(w_ref.dtype)
  u_ref[...] = dot(t, (beta * v_ref[...].astype(F32)).astype(dot_dtype)).astype(u_ref.dtype)
