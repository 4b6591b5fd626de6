"""The backward kernels of Block AttnRes phase 1 (the maths: kernels_pallas/attnres/phase1.py).

vdo    g_ji = do_j . v_i from one read of each do_j and each source
grads  dv_i (plus the gradient of the sources' later uses, which the op passes through) and
       per-program partial dq_j from one more read of each
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.attnres.bf16_split import source_terms
from kernels_pallas.common import compiler_params, feature_chunk


def _vdo_kernel(*refs, n, s, dc):
  do, src, (g_ref,) = refs[:s], refs[s : s + n], refs[s + n :]
  bt, d = src[0].shape

  def body(c, acc):
    cols = pl.ds(c * dc, dc)
    dos = [do[j][:, cols].astype(jnp.float32) for j in range(s)]
    out = []
    for i in range(n):
      v = src[i][:, cols].astype(jnp.float32)
      out += [acc[i * s + j] + jnp.sum(dos[j] * v, axis=1) for j in range(s)]
    return tuple(out)

  acc = jax.lax.fori_loop(0, d // dc, body, (jnp.zeros((bt,), jnp.float32),) * (n * s))
  for i in range(n):
    for j in range(s):
      g_ref[i, j, :] = acc[i * s + j]


def vdo_call(d_outs, sources, settings, interpret):
  """d_outs S and sources n arrays [M, D] -> g [n, S, M] float32, g_ji = do_j . v_i per token."""
  n, (m, d), s = len(sources), sources[0].shape, len(d_outs)
  rows_bt = settings.bt_vdo
  return pl.pallas_call(
    functools.partial(_vdo_kernel, n=n, s=s, dc=feature_chunk(d, settings.dc_vdo)),
    grid=(m // rows_bt,),
    in_specs=[pl.BlockSpec((rows_bt, d), lambda t: (t, 0))] * (s + n),
    out_specs=pl.BlockSpec((n, s, rows_bt), lambda t: (0, 0, t)),
    out_shape=jax.ShapeDtypeStruct((n, s, m), jnp.float32),
    compiler_params=compiler_params(settings, '_vdo'),
    interpret=interpret,
    name='attnres_phase1_vdo',
  )(*d_outs, *sources)


def grads_kernel(*refs, n, s, bt, accumulate, source_parts):
  """One program: a block of rows (rows_grads) by dc features, in steps of bt rows.
  accumulate: dv_in refs (the gradient of the sources' later uses) follow the sources.
  A step stores its n dv tiles only after all of its loads: the compiler cannot tell the outputs
  from the inputs, so no load moves above an earlier store, and storing each source's tile right
  after its own loads makes the next source's loads wait for that store (timings in
  experiments/results/bench_attnres.md). The sums are chains
  of multiply-adds (grad + alpha do, then + b q): one fused instruction per term.
  dq: this program's partial sum_rows b_ji v_i, after the steps: one tensor-core dot per source
  (and bf16 term of the source) of b's bf16 terms [N, rows] (b_parts) against v [rows, dc]."""
  k = n if accumulate else 0
  do, src, dv_in = refs[:s], refs[s : s + n], refs[s + n : s + n + k]
  alpha_ref, b_ref, c_ref, q_ref, b_parts_ref = refs[s + n + k : s + n + k + 5]
  dv, (dq_ref,) = refs[s + n + k + 5 : s + 2 * n + k + 5], refs[s + 2 * n + k + 5 :]
  q = [q_ref[j, :][None, :] for j in range(s)]  # [1, dc] each

  def step(t, carry):
    rows = pl.ds(t * bt, bt)
    dos = [do[j][rows, :].astype(jnp.float32) for j in range(s)]  # [bt, dc] each
    grads = []
    for i in range(n):
      grad = c_ref[i, rows][:, None] * src[i][rows, :].astype(jnp.float32)
      if accumulate:
        grad = grad + dv_in[i][rows, :].astype(jnp.float32)
      for j in range(s):
        grad = grad + alpha_ref[i, j, rows][:, None] * dos[j]
        grad = grad + b_ref[i, j, rows][:, None] * q[j]
      grads.append(grad.astype(dv[i].dtype))
    for i in range(n):
      dv[i][rows, :] = grads[i]
    return carry

  block_rows = src[0].shape[0]
  jax.lax.fori_loop(0, block_rows // bt, step, 0)
  # float32 sources enter the dots as three bf16 terms each: K = 32 rows at a time keeps those in
  # registers (the whole block spills them).
  k_rows = block_rows if source_parts == 1 else min(block_rows, 32)

  def dots(t, dq):
    ks = pl.ds(t * k_rows, k_rows)
    for i in range(n):
      for part in source_terms(src[i][ks, :], source_parts):
        dq += jnp.dot(b_parts_ref[i, :, ks], part, preferred_element_type=jnp.float32)
    return dq

  dq_ref[...] = jax.lax.fori_loop(0, block_rows // k_rows, dots, jnp.zeros(dq_ref.shape, jnp.float32))


def grads_call(kernel, d_outs, sources, d_sources_in, coefficients, settings, interpret=False):
  """The grads kernel's pallas_call (also run by experiments/tools/ablate_attnres_grads.py with copies
  of the kernel): d_outs S and sources n arrays [M, D], d_sources_in n or none, coefficients
  (alpha [n, S, M], b [n, S, M], c [n, M], queries [S, D], b_parts [n, width, M]).
  Returns (n source gradients, per-program dq partials [programs, width, D])."""
  n, (m, d), s = len(sources), sources[0].shape, len(d_outs)
  rows, dc = settings.rows_grads, feature_chunk(d, settings.dc_grads)
  width = coefficients[-1].shape[1]
  tile_spec = pl.BlockSpec((rows, dc), lambda k, t: (t, k))
  *d_sources, dq_parts = pl.pallas_call(
    kernel,
    grid=(d // dc, m // rows),
    in_specs=[tile_spec] * (s + n + len(d_sources_in))
    + [pl.BlockSpec((n, s, rows), lambda k, t: (0, 0, t))] * 2
    + [
      pl.BlockSpec((n, rows), lambda k, t: (0, t)),
      pl.BlockSpec((s, dc), lambda k, t: (0, k)),
      pl.BlockSpec((n, width, rows), lambda k, t: (0, 0, t)),
    ],
    out_specs=[tile_spec] * n + [pl.BlockSpec((None, width, dc), lambda k, t: (t, 0, k))],
    out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype) for x in sources]
    + [jax.ShapeDtypeStruct((m // rows, width, d), jnp.float32)],
    compiler_params=compiler_params(settings, '_grads'),
    interpret=interpret,
    name='attnres_phase1_grads',
  )(*d_outs, *sources, *d_sources_in, *coefficients)
  return d_sources, dq_parts
