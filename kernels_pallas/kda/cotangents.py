"""KDA's per-chunk cotangents in the backward (docs/kda.md), one program per (batch, head, chunk).

With h the state entering the chunk and dh the state gradient after it (both [K, V], from the
state passes), do the output gradient, v_new = u - w h and dv_new its gradient ([C, V]):

  chunk_cotangents_kernel   dqg = do h^T, dkg = v_new dh^T, dw = -dv_new h^T,
                            daqk = tril(do v_new^T), ddecay = rowsum(h * dh) (G_C's decay term)
  wy_bwd_kernel             the transpose of w = T x, u = T y with x = Diag(beta) e^G k and
                            y = Diag(beta) v: dx = T^T dw, dy = T^T du, dT = dw x^T + du y^T,
                            dN = -strict_tril(T^T dT T^T) (T = (I + N)^-1, so nothing is
                            inverted), then dk, dv, dG and dbeta through x and y

Dots take dot-dtype operands with float32 accumulation; the elementwise terms are float32, and
the outputs float32 but dv (final here: written in v's dtype).
Writing these per chunk replaces the batched XLA matmuls over [B, N, C, H, *] views, whose
operands XLA transposed into batch-major layouts first.
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.kda.blocks import F32, dot_nt, dot_tn, iotas


def _causal(c, strict):
  r, j = iotas(c)
  return r > j if strict else r >= j


def chunk_cotangents_kernel(
  h_ref, dh_ref, do_ref, dvn_ref, vn_ref, dqg_ref, dkg_ref, dw_ref, daqk_ref, ddecay_ref, *, dot_dtype
):
  h, dh = h_ref[...].astype(dot_dtype), dh_ref[...].astype(dot_dtype)
  do, vn = do_ref[...].astype(dot_dtype), vn_ref[...].astype(dot_dtype)
  dqg_ref[...] = dot_nt(do, h).astype(dqg_ref.dtype)
  dkg_ref[...] = dot_nt(vn, dh).astype(dkg_ref.dtype)
  dw_ref[...] = (-dot_nt(dvn_ref[...].astype(dot_dtype), h)).astype(dw_ref.dtype)
  daqk_ref[...] = jnp.where(_causal(do.shape[0], strict=False), dot_nt(do, vn), 0.0)
  ddecay_ref[...] = jnp.sum(h.astype(F32) * dh.astype(F32), axis=1)


def wy_bwd_kernel(
  t_ref, dw_ref, du_ref, k_ref, v_ref, g_ref, beta_ref, dn_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, *, dot_dtype
):
  # Each output is written as soon as it is formed, so that few [C, K] float32 tensors are live
  # at once (the kernel is register-bound).
  t = t_ref[...].astype(dot_dtype)
  dw, du = dw_ref[...].astype(dot_dtype), du_ref[...].astype(dot_dtype)
  beta = beta_ref[...].astype(F32)[:, None]
  egk = jnp.exp(g_ref[...]) * k_ref[...].astype(F32)  # e^G k
  dt = dot_nt(dw, (beta * egk).astype(dot_dtype)) + dot_nt(du, (beta * v_ref[...].astype(F32)).astype(dot_dtype))
  inner = dot_nt(dt.astype(dot_dtype), t).astype(dot_dtype)
  dn_ref[...] = jnp.where(_causal(t.shape[0], strict=True), -dot_tn(t, inner), 0.0)
  dx = dot_tn(t, dw)
  dk_ref[...] = beta * jnp.exp(g_ref[...]) * dx
  dg_ref[...] = dx * beta * egk
  dbeta = jnp.sum(dx * egk, axis=1)
  dy = dot_tn(t, du)
  dv_ref[...] = (beta * dy).astype(dv_ref.dtype)
  dbeta_ref[...] = dbeta + jnp.sum(dy * v_ref[...].astype(F32), axis=1)
