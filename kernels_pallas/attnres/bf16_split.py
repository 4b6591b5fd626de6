"""float32 products on bf16 tensor cores: a float32 operand as BF16_TERMS bf16 terms whose sum is
exactly that value, so that a dot of the terms (float32 accumulation) is the float32 dot.

The phase-1 kernels use it for the two sums over features that are matrix products, q_j . v_i
(over D) and dq_j (over tokens): the float32 operand (the queries, the coefficients ds_ji r_i;
also the sources when they are not bf16) enters as its terms, side by side in one operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BF16_TERMS = 3  # bfloat16 terms that hold a float32 value exactly (bf16_parts)


def bf16_parts(x, parts):
  """float32 x as `parts` bfloat16 terms, each x's leading 8 significant bits left over by the
  terms before it (masked off, not rounded: a mask is exact, and no compiler folds it away as it
  may fold a float32 -> bfloat16 -> float32 round trip). Three terms hold a float32 exactly, for
  |x| above about 2^-110 (below, remainders are subnormal and may flush to zero; inf gives nan)."""
  out = []
  for _ in range(parts):
    top = jax.lax.bitcast_convert_type(
      jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32
    )
    out.append(top.astype(jnp.bfloat16))
    x = x - top
  return out


def terms_side_by_side(x, axis):
  """float32 x with S rows along `axis` -> bf16, its BF16_TERMS terms concatenated along `axis`
  (row k * S + j holds term k of row j) and zero-padded to dot_width(S) rows: one operand of a
  dot whose result sum_terms turns back into S float32 rows."""
  s = x.shape[axis]
  stacked = jnp.concatenate(bf16_parts(x.astype(jnp.float32), BF16_TERMS), axis=axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, dot_width(s) - BF16_TERMS * s)
  return jnp.pad(stacked, pad)


def sum_terms(x, s, axis):
  """The sum of the BF16_TERMS groups of S rows along `axis` of a dot with such an operand."""
  return sum(jax.lax.slice_in_dim(x, k * s, (k + 1) * s, axis=axis) for k in range(BF16_TERMS))


def source_parts(sources):
  """bf16 terms per source element in the tensor-core dots: bf16 sources are exact in one."""
  return 1 if sources[0].dtype == jnp.bfloat16 else BF16_TERMS


def source_terms(x, parts):
  """A source tile as the bf16 operands of its dots: x itself (bf16, parts = 1) or its terms."""
  return [x] if parts == 1 else bf16_parts(x.astype(jnp.float32), parts)


def dot_width(s):
  """Columns for BF16_TERMS terms of S queries: a power of two >= 16 (a dot's least)."""
  return max(16, 1 << (BF16_TERMS * s - 1).bit_length())
