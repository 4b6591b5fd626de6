"""KDA decay-weighted scores inside a chunk (docs/kda.md): forward and backward kernels.

With G the within-chunk inclusive cumulative sum of the log-decay (float32, non-increasing):

    aqk[r, i] = scale sum_d q_rd k_id exp(G_rd - G_id)      i <= r
    n[r, i]   = beta_r sum_d k_rd k_id exp(G_rd - G_id)     i < r      (N = Diag(beta) A_kk)

and the chunk's direct terms qg = scale q exp(G), kg = k exp(G_C - G) (written by wy.py's
wy_apply_kernel; their gradients are taken here). The 16-row sub-chunks cut
the [C, C] scores into blocks. A block (a, b) with b < a is one matmul of factors <= 1: its
exponent is split at the first row p of sub-chunk a, G_r - G_i = (G_r - G_p) + (G_p - G_i), both
parts <= 0. In a diagonal block (a, a) the same split makes exp(G_p - G_i) >= 1, so it is a
matmul only where sub-chunk a's G drops by less than blocks.DIAG_MATMUL_RANGE (the usual case);
a steeper sub-chunk takes the pairwise kernels:

- diag_fwd_kernel forms the diagonal blocks of steep sub-chunks token by token: one program per
  token r (and a few heads), walking the tokens j <= r of its sub-chunk, each exp(G_r - G_j) with
  an argument <= 0. Only the causal half of each block is computed; diag_bwd_kernel is its backward.
- scores_fwd_kernel (one program per sub-chunk) writes the score rows: the blocks below the
  diagonal as matmuls, the diagonal block as one more (masked) or from diag_fwd_kernel.
- scores_bwd_kernel applies the transposes of the same products to the score gradients, for the
  rows of sub-chunk a (its queries and keys as rows r) and for its columns (its keys as columns
  i), one slice of the K features per program: every term is elementwise in the features except
  dbeta, which each slice writes as a partial sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.kda.blocks import DIAG_MATMUL_RANGE, F32, SUB, diagonal_by_matmul, dot, dot_nt, dot_tn, iotas, rows


def _token(ref, j):
  """Row j (traced) of a ref as [1, width] float32."""
  return ref[pl.ds(j, 1), :].astype(F32)


def diag_fwd_kernel(q_ref, k_ref, g_ref, b_ref, k_sub_ref, g_sub_ref, aqk_ref, akk_ref, *, scale):
  """Row r of the diagonal blocks of aqk and n for a few heads: q, k, g, beta of token r ([1,
  heads, K] and [1, heads]), k and g of its whole sub-chunk ([16, heads, K]). Writes aqk[r, j] and
  n[r, j] for the 16 tokens j of the sub-chunk (zero above the diagonal), [1, heads, 16]; nothing
  when scores_fwd_kernel forms these blocks as matmuls (blocks.diagonal_by_matmul for all the heads)."""
  r = pl.program_id(1) % SUB

  @pl.when(jnp.logical_not(diagonal_by_matmul(g_sub_ref)))
  def _():
    q, k, g = q_ref[0].astype(F32), k_ref[0].astype(F32), g_ref[0]
    col = jax.lax.broadcasted_iota(jnp.int32, aqk_ref.shape[1:], 1)  # [heads, 16]

    def token(j, carry):  # G is non-increasing, so G_r - G_j <= 0 for j <= r
      aqk, akk = carry
      kj = k_sub_ref[pl.ds(j, 1)][0].astype(F32) * jnp.exp(g - g_sub_ref[pl.ds(j, 1)][0])
      return (
        jnp.where(col == j, jnp.sum(q * kj, axis=-1, keepdims=True), aqk),
        jnp.where(col == j, jnp.sum(k * kj, axis=-1, keepdims=True), akk),
      )

    zeros = jnp.zeros(aqk_ref.shape[1:], F32)
    aqk, akk = jax.lax.fori_loop(0, r + 1, token, (zeros, zeros))
    aqk_ref[0] = (scale * aqk).astype(aqk_ref.dtype)
    akk_ref[0] = jnp.where(col < r, b_ref[...].astype(F32).T * akk, 0.0)


def scores_fwd_kernel(qa_ref, ka_ref, ga_ref, ba_ref, k_ref, g_ref, *refs, scale, nb, dot_dtype, pairwise):
  """Sub-chunk a of one chunk: its score rows aqk, n [16, C]. refs: (aqk_d, n_d, aqk, n) with
  pairwise, else (aqk, n). The diagonal block is formed here as matmuls when
  blocks.diagonal_by_matmul allows, else taken from diag_fwd_kernel's output (aqk_d, n_d [16, 16]).
  Without pairwise (no sub-chunk of the call is steep: blocks.any_steep) it is always a matmul."""
  *diag_refs, aqk_ref, n_ref = refs
  a = pl.program_id(3)
  qa, ka, ga = qa_ref[...].astype(F32), ka_ref[...].astype(F32), ga_ref[...]
  beta = ba_ref[...].astype(F32)[:, None]

  gp = _token(g_ref, a * SUB)  # anchor: the sub-chunk's first row
  row_f = jnp.exp(ga - gp)
  qa_f, ka_f = (qa * row_f).astype(dot_dtype), (ka * row_f).astype(dot_dtype)

  by_matmul = diagonal_by_matmul(ga_ref) if pairwise else jnp.bool_(True)
  r_idx, c_idx = iotas()

  if pairwise:
    aqk_d_ref, n_d_ref = diag_refs

    @pl.when(jnp.logical_not(by_matmul))
    def _():
      aqk_ref[:, rows(a)] = aqk_d_ref[...].astype(aqk_ref.dtype)
      n_ref[:, rows(a)] = n_d_ref[...]

  def earlier(b, carry):  # blocks (a, b), b < a, and the diagonal block (a, a) when by_matmul
    kb = (k_ref[rows(b), :].astype(F32) * jnp.exp(gp - g_ref[rows(b), :])).astype(dot_dtype)
    aqk_ref[:, rows(b)] = jnp.where((b < a) | (c_idx <= r_idx), scale * dot_nt(qa_f, kb), 0.0).astype(aqk_ref.dtype)
    n_ref[:, rows(b)] = jnp.where((b < a) | (c_idx < r_idx), beta * dot_nt(ka_f, kb), 0.0)
    return carry

  def later(b, carry):  # blocks above the diagonal
    aqk_ref[:, rows(b)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
    n_ref[:, rows(b)] = jnp.zeros((SUB, SUB), F32)
    return carry

  jax.lax.fori_loop(0, a + by_matmul.astype(jnp.int32), earlier, None)
  jax.lax.fori_loop(a + 1, nb, later, None)


def diag_bwd_kernel(
  g_ref,
  daqk_ref,
  dn_ref,
  q_sub_ref,
  k_sub_ref,
  g_sub_ref,
  beta_sub_ref,
  daqk_sub_ref,
  dn_sub_ref,
  qrow_ref,
  rrow_ref,
  ccol_ref,
  *,
  scale,
):
  """The diagonal blocks' part of the scores backward for token r and a few heads. Inputs: g of
  token r [1, heads, K]; its row of the diagonal blocks of daqk and dn [1, heads, 16]; q, k, g,
  beta of its sub-chunk [16, heads, K] and [16, heads]; the sub-chunk's rows of the diagonal
  blocks of daqk and dn [16, heads, 16]. Outputs [1, heads, K], with E_ij = exp(G_i - G_j):

    qrow_r = sum_{j <= r} daqk[r, j] k_j E_rj            (dq_r = scale qrow_r)
    rrow_r = sum_{j < r} dn[r, j] k_j E_rj               (through n's row factor k_r)
    ccol_r = sum_{i >= r} (scale daqk[i, r] q_i + beta_i dn[i, r] k_i) E_ir    (k_r as a column)

  daqk and dn are zero above (and dn on) the diagonal, so the sums run over the whole loops.
  Nothing is written when scores_bwd_kernel forms these terms as matmuls (diagonal_by_matmul)."""
  r = pl.program_id(1) % SUB
  one = lambda ref, j: ref[pl.ds(j, 1)][0]  # token j of a sub-chunk block, [heads, ...]
  grad = lambda ref, i, j: ref[pl.ds(i, 1), :, pl.ds(j, 1)][0].astype(F32)  # [heads, 1]

  @pl.when(jnp.logical_not(diagonal_by_matmul(g_sub_ref)))
  def _():
    g = g_ref[0]

    def row(j, carry):
      qrow, rrow = carry
      kj = one(k_sub_ref, j).astype(F32) * jnp.exp(g - one(g_sub_ref, j))
      return qrow + grad(daqk_ref, 0, j) * kj, rrow + grad(dn_ref, 0, j) * kj

    def column(i, ccol):
      beta_i = one(beta_sub_ref, i).astype(F32)[:, None]
      x = scale * grad(daqk_sub_ref, i, r) * one(q_sub_ref, i).astype(F32) + grad(dn_sub_ref, i, r) * beta_i * one(
        k_sub_ref, i
      ).astype(F32)
      return ccol + x * jnp.exp(one(g_sub_ref, i) - g)

    zero = jnp.zeros(g.shape, F32)
    qrow, rrow = jax.lax.fori_loop(0, r + 1, row, (zero, zero))
    qrow_ref[0], rrow_ref[0] = qrow, rrow
    ccol_ref[0] = jax.lax.fori_loop(r, SUB, column, zero)


def scores_bwd_kernel(
  qa_ref,
  ka_ref,
  ga_ref,
  ba_ref,
  dqg_ref,
  dkg_ref,
  daqk_rows_ref,
  dn_rows_ref,
  q_ref,
  k_ref,
  g_ref,
  b_ref,
  daqk_ref,
  dn_ref,
  *refs,
  scale,
  nb,
  dot_dtype,
  pairwise,
):
  """Gradients through the scores and the direct terms, for the rows of sub-chunk a.

  Inputs: the score gradients daqk (of aqk as defined above, scale inside) and dn (of N), both
  [C, C] per chunk, and dqg, dkg for the sub-chunk's rows. Outputs for its rows: dq, dk, dG (the
  cumulative log-decay's gradient, before the reverse cumulative sum), dbeta (through N), and
  dlast [1, K], this sub-chunk's part of the gradient of G_C through kg. With R_r = sum_i dN_ri
  k_i exp(G_r - G_i): dA_kk = Diag(beta) dN gives beta_r R_r to dk_r and sum_d k_rd R_rd to dbeta_r.
  The diagonal blocks' terms (qrow, rrow, ccol of diag_bwd_kernel) and the UT transform's
  gradients of k, G and beta (dk_wy, dg_wy, dbeta_wy) come in as inputs; this kernel adds the
  blocks off the diagonal (matmuls), the diagonal ones where they are matmuls, and the direct
  terms, so dq and dk leave it final. refs: qrow, rrow, ccol (diag_bwd_kernel's, with pairwise
  only), dk_wy, dg_wy, dbeta_wy, then the outputs dq, dk, dg, dbeta, dlast. Without pairwise no
  sub-chunk of the call is steep (blocks.any_steep) and every diagonal block is a matmul.
  """
  *diag_refs, dk_wy_ref, dg_wy_ref, dbeta_wy_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, dlast_ref = refs
  # Each output is written, and each partial sum folded, as soon as its terms exist, so that few
  # [16, features] float32 tensors are live at once (the kernel is register-bound).
  a = pl.program_id(3)
  c = nb * SUB
  # With diagonal_by_matmul the diagonal block is one more matmul of each kind (b = a below, m = a
  # for the columns; the exponent split at p) and diag_bwd_kernel's terms are not read.
  by_matmul = diagonal_by_matmul(ga_ref) if pairwise else jnp.bool_(True)
  qrow_ref, rrow_ref, ccol_ref = diag_refs if pairwise else (None,) * 3
  diag = by_matmul.astype(jnp.int32)
  ka, ga = ka_ref[...].astype(F32), ga_ref[...]
  beta = ba_ref[...].astype(F32)[:, None]
  zero = jnp.zeros_like(ka)

  # rows of a against earlier sub-chunks b < a, and b = a by matmul (anchor: the first row p of a)
  gp = _token(g_ref, a * SUB)

  def earlier(b, carry):
    kb = (k_ref[rows(b), :].astype(F32) * jnp.exp(gp - g_ref[rows(b), :])).astype(dot_dtype)
    return (
      carry[0] + dot(daqk_rows_ref[:, rows(b)].astype(dot_dtype), kb),
      carry[1] + dot(dn_rows_ref[:, rows(b)].astype(dot_dtype), kb),
    )

  diag_term = lambda ref: jnp.where(by_matmul, 0.0, ref[...]) if pairwise else 0.0
  qrow_o, rrow_o = jax.lax.fori_loop(0, a + diag, earlier, (zero, zero))
  row_f = jnp.exp(ga - gp)
  qrow = scale * (diag_term(qrow_ref) + row_f * qrow_o)  # the gradient of q through the scores
  rrow = diag_term(rrow_ref) + row_f * rrow_o  # R_r: dk_r gets beta_r R_r, dbeta_r k_r . R_r

  # direct terms qg = scale q exp(G), kg = k exp(G_C - G), and the rows' terms
  qa = qa_ref[...].astype(F32)
  eg = jnp.exp(ga)
  dqg = dqg_ref[...].astype(F32)
  dq_ref[...] = (scale * eg * dqg + qrow).astype(dq_ref.dtype)
  first_slice = pl.program_id(4) == 0  # dbeta_wy goes into one slice's partial sum
  dbeta_ref[...] = jnp.sum(ka * rrow, axis=1) + jnp.where(first_slice, dbeta_wy_ref[...].astype(F32), 0.0)
  rrow = beta * rrow
  eg_end = jnp.exp(_token(g_ref, c - 1) - ga)
  dkg = dkg_ref[...].astype(F32)
  kg_term = dkg * ka * eg_end
  dlast_ref[...] = jnp.sum(kg_term, axis=0, keepdims=True)
  dg = scale * qa * eg * dqg - kg_term + qa * qrow + ka * rrow
  dk = eg_end * dkg + rrow

  # columns of a against later sub-chunks m > a (anchor: the first row of m)
  def column_part(m):
    gpm = _token(g_ref, m * SUB)
    fm = jnp.exp(g_ref[rows(m), :] - gpm)
    qm = (scale * q_ref[rows(m), :].astype(F32) * fm).astype(dot_dtype)
    km = (k_ref[rows(m), :].astype(F32) * fm * b_ref[rows(m)].astype(F32)[:, None]).astype(dot_dtype)
    part = dot_tn(daqk_ref[rows(m), rows(a)].astype(dot_dtype), qm) + dot_tn(
      dn_ref[rows(m), rows(a)].astype(dot_dtype), km
    )
    return gpm, part

  def later(m, ccol_o):
    gpm, part = column_part(m)
    return ccol_o + jnp.exp(gpm - ga) * part

  # the diagonal block's columns: by matmul (exp(G_p - G_r) >= 1, clipped so that a steep
  # sub-chunk, which takes diag_bwd_kernel's terms instead, computes nothing infinite) or pairwise
  _, part = column_part(a)
  ccol_diag = jnp.exp(jnp.minimum(gp - ga, DIAG_MATMUL_RANGE)) * part
  if pairwise:
    ccol_diag = jnp.where(by_matmul, ccol_diag, ccol_ref[...])
  ccol = jax.lax.fori_loop(a + 1, nb, later, ccol_diag)
  dk_ref[...] = (dk + ccol + dk_wy_ref[...]).astype(dk_ref.dtype)
  dg_ref[...] = dg - ka * ccol + dg_wy_ref[...]
