"""KDA's UT transform inside a chunk (SPEC §1): W = T Diag(beta) (exp(G) k), U = T Diag(beta) v with
T = (I + N)^-1, N = Diag(beta) A_kk strictly lower-triangular (from scores.py).

wy_fwd_kernel: one program per chunk; T's 16 x 16 blocks by forward substitution and block
products in float32 (full-precision dots), then W and U on the tensor cores (dot dtype operands,
float32 accumulation); optionally T itself, for the backward. wy_bwd: the transpose of the map
in XLA, from T (no inverse to differentiate).
"""

from __future__ import annotations

import jax.numpy as jnp

from kernels_pallas.kda.blocks import F32, dot, einsum, inverse_blocks, rows


def wy_fwd_kernel(n_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, *t_ref, nb, dot_dtype):
  t = inverse_blocks([[n_ref[rows(a), rows(b)] if b <= a else None for b in range(nb)]
                      for a in range(nb)], nb)
  for a in range(nb):
    w = jnp.zeros(w_ref[rows(a), :].shape, F32)
    u = jnp.zeros(u_ref[rows(a), :].shape, F32)
    for b in range(a + 1):
      beta = beta_ref[rows(b)].astype(F32)[:, None]
      x = (beta * jnp.exp(g_ref[rows(b), :]) * k_ref[rows(b), :].astype(F32)).astype(dot_dtype)
      y = (beta * v_ref[rows(b), :].astype(F32)).astype(dot_dtype)
      tab = t[a][b].astype(dot_dtype)
      w, u = w + dot(tab, x), u + dot(tab, y)
    w_ref[rows(a), :] = w.astype(w_ref.dtype)
    u_ref[rows(a), :] = u.astype(u_ref.dtype)
    if t_ref:
      for b in range(nb):
        t_ref[0][rows(a), rows(b)] = t[a][b] if b <= a else jnp.zeros_like(t[a][a])


def wy_bwd(t, dw, du, k, v, gc, beta, dot_dtype):
  """Gradients through (w, u), on chunk views [B, N, C, H, *] (t [B, N, C, H, C] float32 as
  written by wy_fwd_kernel; the products take dot_dtype operands, float32 accumulation): (dn, dk,
  dv, dg, dbeta) float32, dn strictly lower-triangular in (row, column), dg the gradient of the
  cumulative log-decay G."""
  mm = lambda spec, x_, y_: einsum(spec, x_, y_, dot_dtype)
  eg = jnp.exp(gc)
  k, v, beta = k.astype(F32), v.astype(F32), beta.astype(F32)[..., None]
  x, y = beta * eg * k, beta * v
  dx, dy = mm('bnrhi,bnrhd->bnihd', t, dw), mm('bnrhi,bnrhd->bnihd', t, du)
  dt = mm('bnrhd,bnihd->bnrhi', dw, x) + mm('bnrhd,bnihd->bnrhi', du, y)
  c = t.shape[2]
  below = jnp.tri(c, k=-1, dtype=bool)[:, None, :]
  dn = -jnp.where(below, mm('bnmhr,bnmhi->bnrhi', t, mm('bnmhj,bnihj->bnmhi', dt, t)), 0.0)
  dbeta = jnp.sum(dx * eg * k, axis=-1) + jnp.sum(dy * v, axis=-1)
  return dn, beta * eg * dx, beta * dy, dx * x, dbeta
