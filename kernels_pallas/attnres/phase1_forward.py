"""The forward kernels of Block AttnRes phase 1 (the maths: kernels_pallas/attnres/phase1.py).

logits   reads each source once: r [n, M] and the query dots (q_j . v_i) r_i, as
         [n, M, BF16_TERMS * S padded] (the terms are summed after the kernel)
combine  reads each source once, writes the S outputs o_j [M, D]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.attnres.bf16_split import source_parts, source_terms
from kernels_pallas.common import compiler_params, feature_chunk


def _logits_kernel(*refs, n, dc, eps, source_parts):
  """Per source: sum of squares by elementwise products, and the dots with the queries' bf16
  terms (terms_side_by_side) on the tensor cores (bf16 operands, float32 accumulation); writes
  r and the dots times r, whose BF16_TERMS groups of S columns sum to the logits."""
  src, (q_ref,), (terms_ref, r_ref) = refs[:n], refs[n : n + 1], refs[n + 1 :]
  bt, d = src[0].shape
  for i in range(n):

    def body(c, carry, i=i):  # i bound per source: the loop unrolls at trace time
      cols = pl.ds(c * dc, dc)
      v = src[i][:, cols]  # [bt, dc]
      v32 = v.astype(jnp.float32)
      sumsq, dots = carry
      for part in source_terms(v, source_parts):
        dots += jnp.dot(part, q_ref[cols, :], preferred_element_type=jnp.float32)
      return sumsq + jnp.sum(v32 * v32, axis=1), dots

    carry = (jnp.zeros((bt,), jnp.float32), jnp.zeros((bt, q_ref.shape[1]), jnp.float32))
    sumsq, dots = jax.lax.fori_loop(0, d // dc, body, carry)
    r = jax.lax.rsqrt(sumsq / d + eps)
    r_ref[i, :] = r
    terms_ref[i, :, :] = dots * r[:, None]


def _combine_kernel(*refs, n, s):
  src, (alpha_ref,), outs = refs[:n], refs[n : n + 1], refs[n + 1 :]
  acc = [None] * s
  for i in range(n):
    v = src[i][...].astype(jnp.float32)  # [bt, dc]
    for j in range(s):
      term = alpha_ref[i, j, :][:, None] * v
      acc[j] = term if acc[j] is None else acc[j] + term
  for j in range(s):
    outs[j][...] = acc[j].astype(outs[j].dtype)


def logits_call(sources, q_parts, eps, settings, interpret):
  """sources n arrays [M, D], q_parts [D, width] (the queries' terms side by side) ->
  (terms [n, M, width] float32, r [n, M] float32)."""
  n, (m, d) = len(sources), sources[0].shape
  rows = settings.bt_logits
  return pl.pallas_call(
    functools.partial(
      _logits_kernel, n=n, dc=feature_chunk(d, settings.dc_logits), eps=eps, source_parts=source_parts(sources)
    ),
    grid=(m // rows,),
    in_specs=[pl.BlockSpec((rows, d), lambda t: (t, 0))] * n + [pl.BlockSpec(q_parts.shape, lambda t: (0, 0))],
    out_specs=[
      pl.BlockSpec((n, rows, q_parts.shape[1]), lambda t: (0, t, 0)),
      pl.BlockSpec((n, rows), lambda t: (0, t)),
    ],
    out_shape=[jax.ShapeDtypeStruct((n, m, q_parts.shape[1]), jnp.float32), jax.ShapeDtypeStruct((n, m), jnp.float32)],
    compiler_params=compiler_params(settings, '_logits'),
    interpret=interpret,
    name='attnres_phase1_logits',
  )(*sources, q_parts)


def combine_call(sources, alpha, settings, interpret):
  """sources n arrays [M, D], alpha [n, S, M] float32 -> S outputs [M, D] in the sources' dtype."""
  n, (m, d), s = len(sources), sources[0].shape, alpha.shape[1]
  bt, dc = settings.bt, feature_chunk(d, settings.dc)
  tile_spec = pl.BlockSpec((bt, dc), lambda t, c: (t, c))
  return pl.pallas_call(
    functools.partial(_combine_kernel, n=n, s=s),
    grid=(m // bt, d // dc),
    in_specs=[tile_spec] * n + [pl.BlockSpec((n, s, bt), lambda t, c: (0, 0, t))],
    out_specs=[tile_spec] * s,
    out_shape=[jax.ShapeDtypeStruct((m, d), sources[0].dtype)] * s,
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='attnres_phase1_combine',
  )(*sources, alpha)
