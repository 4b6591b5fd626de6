"""Helpers shared by the KDA kernels: 16-row sub-chunk views, the dots, exact triangular inverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SUB = 16  # rows of a sub-chunk: the unit of the exponent split and of the blockwise inverse
F32 = jnp.float32
# HIGHEST: float32 operands multiply in full precision (IEEE), not TF32; bf16 operands are
# unaffected (tensor cores, float32 accumulation).
_HI = jax.lax.Precision.HIGHEST


# A sub-chunk whose cumulative log-decay G falls by less than this in every feature (of the
# heads a program covers) has its diagonal score block formed by matmuls split at its first row p,
# like the blocks below it: the factors exp(G_p - G_j) of its keys stay below e^60 (~1e26), inside
# float32's and bf16's range, and their products with exp(G_r - G_p) <= 1 are exp(G_r - G_j). Steeper
# sub-chunks (a reset, decays near -4 per token or below) take the pairwise kernels, whose every exp
# has an argument <= 0.
DIAG_MATMUL_RANGE = 60.0


def diagonal_by_matmul(g_ref):
  """Whether the sub-chunk held by g_ref ([16, ...] float32 G, rows = its tokens) falls by less
  than DIAG_MATMUL_RANGE in every feature: a traced boolean scalar. G is non-increasing along the
  rows, so its drop is first row minus last."""
  drop = g_ref[pl.ds(0, 1)] - g_ref[pl.ds(SUB - 1, 1)]
  while drop.ndim > 1:
    drop = jnp.max(drop, axis=-1)
  return jnp.max(drop) < DIAG_MATMUL_RANGE


def any_steep(gc):
  """Whether any 16-token sub-chunk of G [B, T, H, K] (T a multiple of 16) would fail
  diagonal_by_matmul, for any head: a traced boolean scalar, computed by XLA from each sub-chunk's
  first and last rows (an eighth of G). The same float32 subtraction and comparison as the kernels',
  so that when it is False every kernel's diagonal_by_matmul is True."""
  b, t, h, dk = gc.shape
  sub = gc.reshape(b, t // SUB, SUB, h, dk)
  return jnp.any(sub[:, :, 0] - sub[:, :, SUB - 1] >= DIAG_MATMUL_RANGE)


def rows(a, n=SUB):
  """Rows [a n, a n + n) of a ref; a may be traced."""
  return pl.ds(a * n if isinstance(a, int) else pl.multiple_of(a * n, n), n)


def _dot(x, y, dims):
  return jax.lax.dot_general(x, y, (dims, ((), ())), precision=_HI, preferred_element_type=F32)


def dot(x, y):
  """x [M, D] . y [D, N] -> [M, N] float32."""
  return _dot(x, y, ((1,), (0,)))


def dot_nt(x, y):
  """x [M, D] . y [N, D]^T -> [M, N] float32 (contraction over the last axis of both)."""
  return _dot(x, y, ((1,), (1,)))


def dot_tn(x, y):
  """x [D, M]^T . y [D, N] -> [M, N] float32 (contraction over the first axis of both)."""
  return _dot(x, y, ((0,), (0,)))


def iotas(n=SUB):
  """(row index, column index) of an [n, n] block, int32."""
  return (jax.lax.broadcasted_iota(jnp.int32, (n, n), 0), jax.lax.broadcasted_iota(jnp.int32, (n, n), 1))


def unit_lower_inverse(n):
  """(I + n)^-1 for a strictly lower-triangular [16, 16] float32 n, as (I - n)(I + n^2)(I + n^4)
  (I + n^8): exact, since n^16 = 0, and six dots with no row-by-row loop (the powers commute)."""
  r_idx, c_idx = iotas()
  t = (r_idx == c_idx).astype(F32) - n
  power = n
  for _ in range(3):
    power = dot(power, power)
    t = t + dot(t, power)
  return t


def inverse_blocks(nblk, nb):
  """Blocks T[a][b] (b <= a) of (I + N)^-1 from the blocks nblk[a][b] (b <= a) of a strictly
  lower-triangular N: T_aa by unit_lower_inverse, T_ab = -T_aa sum_{b <= m < a} N_am T_mb."""
  t = [[None] * nb for _ in range(nb)]
  for a in range(nb):
    t[a][a] = unit_lower_inverse(nblk[a][a])
    for b in range(a - 1, -1, -1):
      t[a][b] = -dot(t[a][a], sum(dot(nblk[a][m], t[m][b]) for m in range(b, a)))
  return t
