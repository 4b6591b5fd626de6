"""KDA decay-weighted scores inside a chunk (SPEC §1): forward and backward kernels.

One program = one 16-row sub-chunk a of one chunk of one (batch, head). With G the within-chunk
inclusive cumulative sum of the log-decay (float32, non-increasing):

    aqk[r, i] = scale sum_d q_rd k_id exp(G_rd - G_id)      i <= r
    n[r, i]   = beta_r sum_d k_rd k_id exp(G_rd - G_id)     i < r      (N = Diag(beta) A_kk)

and the chunk's direct terms qg = scale q exp(G), kg = k exp(G_C - G). A block (a, b) with b < a
is one matmul of factors <= 1: its exponent is split at the first row p of sub-chunk a,
G_r - G_i = (G_r - G_p) + (G_p - G_i), both parts <= 0. A diagonal block has no such split, so it
is formed column by column from exp(G_r - G_j), with the exponent clamped to <= 0 before the exp
and the entries above the diagonal masked. The backward kernel applies the transposes of the same
products to the score gradients: for the rows of sub-chunk a (its queries and keys as rows r)
and for its columns (its keys as columns i), in one program.

The forward's diagonal blocks take exp(G_r - G_j) for all 16 x 16 pairs of a feature slice at
once, as a [16, 16, FEATURES] tensor, walking the K features in such slices.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.blocks import F32, SUB, dot, dot_nt, dot_tn, iotas, rows

FEATURES = 32   # features per slice of the diagonal blocks' pairwise decay factors


def _token(ref, j):
  """Row j (traced) of a ref as [1, width] float32."""
  return ref[pl.ds(j, 1), :].astype(F32)


def _pair_decay(g):
  """exp(G_r - G_j) for the 16 x 16 pairs (r, j) of a sub-chunk, [16, 16, F] from g [16, F],
  with the exponent clamped to <= 0 (the pairs j > r, where it is positive, are masked later)."""
  return jnp.exp(jnp.minimum(g[:, None, :] - g[None, :, :], 0.0))


def _slices(dk):
  width = min(FEATURES, dk)
  return dk // width, lambda s: pl.ds(pl.multiple_of(s * width, width), width)


def scores_fwd_kernel(qa_ref, ka_ref, ga_ref, ba_ref, k_ref, g_ref, qg_ref, kg_ref, aqk_ref, n_ref, *,
                      scale, nb, dot_dtype):
  a = pl.program_id(3)
  c = nb * SUB
  qa, ka, ga = qa_ref[...].astype(F32), ka_ref[...].astype(F32), ga_ref[...]
  beta = ba_ref[...].astype(F32)[:, None]
  qg_ref[...] = (scale * qa * jnp.exp(ga)).astype(qg_ref.dtype)
  kg_ref[...] = (ka * jnp.exp(_token(g_ref, c - 1) - ga)).astype(kg_ref.dtype)

  n_slices, cols = _slices(ka.shape[-1])

  def diagonal(s, carry):   # the diagonal block, one feature slice
    aqk, akk = carry
    at = cols(s)
    q_s, k_s = qa_ref[:, at].astype(F32), ka_ref[:, at].astype(F32)
    ke = k_s[None, :, :] * _pair_decay(ga_ref[:, at])           # k_j exp(G_r - G_j) [r, j, F]
    return aqk + jnp.sum(q_s[:, None, :] * ke, axis=2), akk + jnp.sum(k_s[:, None, :] * ke, axis=2)

  zeros = jnp.zeros((SUB, SUB), F32)
  aqk, akk = jax.lax.fori_loop(0, n_slices, diagonal, (zeros, zeros))
  r_idx, c_idx = iotas()
  aqk_ref[:, rows(a)] = jnp.where(r_idx >= c_idx, scale * aqk, 0.0).astype(aqk_ref.dtype)
  n_ref[:, rows(a)] = jnp.where(r_idx > c_idx, beta * akk, 0.0)

  gp = _token(g_ref, a * SUB)                                  # anchor: the sub-chunk's first row
  row_f = jnp.exp(ga - gp)
  qa_f, ka_f = (qa * row_f).astype(dot_dtype), (ka * row_f).astype(dot_dtype)

  def earlier(b, carry):  # blocks (a, b), b < a
    kb = (k_ref[rows(b), :].astype(F32) * jnp.exp(gp - g_ref[rows(b), :])).astype(dot_dtype)
    aqk_ref[:, rows(b)] = (scale * dot_nt(qa_f, kb)).astype(aqk_ref.dtype)
    n_ref[:, rows(b)] = beta * dot_nt(ka_f, kb)
    return carry

  def later(b, carry):    # blocks above the diagonal
    aqk_ref[:, rows(b)] = zeros.astype(aqk_ref.dtype)
    n_ref[:, rows(b)] = zeros
    return carry

  jax.lax.fori_loop(0, a, earlier, None)
  jax.lax.fori_loop(a + 1, nb, later, None)


def scores_bwd_kernel(qa_ref, ka_ref, ga_ref, ba_ref, dqg_ref, dkg_ref, daqk_rows_ref, dn_rows_ref,
                      q_ref, k_ref, g_ref, b_ref, daqk_ref, dn_ref,
                      dq_ref, dk_ref, dg_ref, dbeta_ref, dlast_ref, *, scale, nb, dot_dtype):
  """Gradients through the scores and the direct terms, for the rows of sub-chunk a.

  Inputs: the score gradients daqk (of aqk as defined above, scale inside) and dn (of N), both
  [C, C] per chunk, and dqg, dkg for the sub-chunk's rows. Outputs for its rows: dq, dk, dG (the
  cumulative log-decay's gradient, before the reverse cumulative sum), dbeta (through N), and
  dlast [1, K], this sub-chunk's part of the gradient of G_C through kg. With R_r = sum_i dN_ri
  k_i exp(G_r - G_i): dA_kk = Diag(beta) dN gives beta_r R_r to dk_r and sum_d k_rd R_rd to dbeta_r.
  The diagonal block goes column by column here (one token j of the sub-chunk at a time): on the
  H200 that measured faster than the pairwise [16, 16, F] form the forward uses.
  """
  a = pl.program_id(3)
  c = nb * SUB
  qa, ka, ga = qa_ref[...].astype(F32), ka_ref[...].astype(F32), ga_ref[...]
  beta = ba_ref[...].astype(F32)[:, None]
  rid = jax.lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
  qs = scale * qa

  # direct terms: qg = scale q exp(G), kg = k exp(G_C - G)
  eg, eg_end = jnp.exp(ga), jnp.exp(_token(g_ref, c - 1) - ga)
  dqg, dkg = dqg_ref[...].astype(F32), dkg_ref[...].astype(F32)
  kg_term = dkg * ka * eg_end
  dlast_ref[...] = jnp.sum(kg_term, axis=0, keepdims=True)

  def column(j, carry):   # the diagonal block, column j = token j of the sub-chunk
    qrow, rrow, ccol = carry
    tok = a * SUB + j
    kj = _token(k_ref, tok)
    e = jnp.exp(jnp.minimum(ga - _token(g_ref, tok), 0.0))     # exp(G_r - G_j), rows r >= j used
    daq = jnp.where(rid >= j, daqk_rows_ref[:, pl.ds(tok, 1)].astype(F32), 0.0)   # [16, 1]
    dnn = jnp.where(rid > j, dn_rows_ref[:, pl.ds(tok, 1)], 0.0)
    vec = jnp.sum((daq * qs + dnn * beta * ka) * e, axis=0, keepdims=True)       # [1, K]
    return qrow + daq * kj * e, rrow + dnn * kj * e, jnp.where(rid == j, vec, ccol)

  zero = jnp.zeros_like(ka)
  qrow, rrow, ccol = jax.lax.fori_loop(0, SUB, column, (zero, zero, zero))

  # rows of a against earlier sub-chunks b < a (anchor: the first row p of a)
  gp = _token(g_ref, a * SUB)

  def earlier(b, carry):
    kb = (k_ref[rows(b), :].astype(F32) * jnp.exp(gp - g_ref[rows(b), :])).astype(dot_dtype)
    return (carry[0] + dot(daqk_rows_ref[:, rows(b)].astype(dot_dtype), kb),
            carry[1] + dot(dn_rows_ref[:, rows(b)].astype(dot_dtype), kb))

  qrow_o, rrow_o = jax.lax.fori_loop(0, a, earlier, (zero, zero))
  row_f = jnp.exp(ga - gp)
  qrow = scale * (qrow + row_f * qrow_o)          # the gradient of q through the scores
  rrow = rrow + row_f * rrow_o

  # columns of a against later sub-chunks m > a (anchor: the first row of m)
  def later(m, ccol_o):
    gpm = _token(g_ref, m * SUB)
    fm = jnp.exp(g_ref[rows(m), :] - gpm)
    qm = (scale * q_ref[rows(m), :].astype(F32) * fm).astype(dot_dtype)
    km = (k_ref[rows(m), :].astype(F32) * fm * b_ref[rows(m)].astype(F32)[:, None]).astype(dot_dtype)
    part = (dot_tn(daqk_ref[rows(m), rows(a)].astype(dot_dtype), qm)
            + dot_tn(dn_ref[rows(m), rows(a)].astype(dot_dtype), km))
    return ccol_o + jnp.exp(gpm - ga) * part

  ccol = ccol + jax.lax.fori_loop(a + 1, nb, later, zero)
  dq_ref[...] = (scale * eg * dqg + qrow).astype(dq_ref.dtype)
  dk_ref[...] = (eg_end * dkg + beta * rrow + ccol).astype(dk_ref.dtype)
  dg_ref[...] = qs * eg * dqg - kg_term + qa * qrow + ka * (beta * rrow) - ka * ccol
  dbeta_ref[...] = jnp.sum(ka * rrow, axis=1)
