"""KDA chunk-to-chunk state kernels (docs/kda.md): the forward pass over chunks and its reverse.

One program = one (batch, head) and one block of BV value columns; it walks the chunks in order
(forward) or in reverse (backward) with its [K, BV] slice of the float32 state in registers. Per
chunk of C tokens, with the intra-chunk tensors of scores.py and wy.py (qg, kg, aqk, w, u) and the
chunk's total decay exp(G_C):

  forward    v_new = u - w S;  o = qg S + aqk v_new;  S <- exp(G_C) S + kg^T v_new
  backward   dv_new = aqk^T do + kg dS;  dS <- exp(G_C) dS + qg^T do - w^T dv_new

For the backward, the forward writes instead of o the state entering every chunk (h) and v_new;
the backward writes the state gradient after every chunk (dh) and dv_new. The state enters its
dots in the dot dtype (bf16 for bf16 inputs) with float32 accumulation, and h and dh are written
in that dtype, as the dots read them; the state itself and its updates stay float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.blocks import F32, dot, dot_tn


def _decay_column(g_ref, n, c):
  """exp(G_C) of chunk n as a [K, 1] column (G_C: the chunk's last cumulative log-decay row)."""
  return jnp.exp(g_ref[n * c + c - 1, :]).astype(F32)[:, None]


def state_fwd_kernel(
  qg_ref, kg_ref, w_ref, u_ref, aqk_ref, g_ref, s0_ref, out_ref, s_out_ref, *h_ref, nt, c, dot_dtype
):
  """out: o, or, when h is written (for the backward), v_new instead (o is not needed there)."""
  dk = qg_ref.shape[-1]

  def chunk(n, s):
    at = pl.ds(n * c, c)
    s_d = s.astype(dot_dtype)
    v_new = u_ref[at, :].astype(F32) - dot(w_ref[at, :], s_d)
    v_new_d = v_new.astype(dot_dtype)
    if h_ref:
      h_ref[0][pl.ds(n * dk, dk), :] = s_d.astype(h_ref[0].dtype)
      out_ref[at, :] = v_new_d.astype(out_ref.dtype)
    else:
      out_ref[at, :] = (dot(qg_ref[at, :], s_d) + dot(aqk_ref[at, :], v_new_d)).astype(out_ref.dtype)
    return _decay_column(g_ref, n, c) * s + dot_tn(kg_ref[at, :], v_new_d)

  s_out_ref[...] = jax.lax.fori_loop(0, nt, chunk, s0_ref[...].astype(F32))


def state_bwd_kernel(
  qg_ref, kg_ref, w_ref, aqk_ref, g_ref, do_ref, ds_out_ref, ds0_ref, dh_ref, dv_new_ref, *, nt, c, dot_dtype
):
  dk = qg_ref.shape[-1]

  def chunk(i, ds):
    n = nt - 1 - i
    at = pl.ds(n * c, c)
    ds_d = ds.astype(dot_dtype)
    dh_ref[pl.ds(n * dk, dk), :] = ds_d.astype(dh_ref.dtype)
    do = do_ref[at, :].astype(dot_dtype)
    dv_new = dot_tn(aqk_ref[at, :], do) + dot(kg_ref[at, :], ds_d)
    dv_new_ref[at, :] = dv_new.astype(dv_new_ref.dtype)
    return _decay_column(g_ref, n, c) * ds + dot_tn(qg_ref[at, :], do) - dot_tn(w_ref[at, :], dv_new.astype(dot_dtype))

  ds0_ref[...] = jax.lax.fori_loop(0, nt, chunk, ds_out_ref[...].astype(F32))
