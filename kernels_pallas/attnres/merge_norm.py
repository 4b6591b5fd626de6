"""Phase 2 of Block Attention Residuals (docs/attention_residuals.md) fused with the consumer's pre-norm, as Pallas
(Triton) kernels, forward and backward.

Per token, a consumer merges its phase-1 output o (and logsumexp lse) with its block's partial
sum p, using its effective query q, and its sublayer normalises the result with gain gamma:

    r_p = rsqrt(mean_d p^2 + eps),     s_p = (q . p) r_p,     sigma = sigmoid(lse - s_p)
    h = sigma o + (1 - sigma) p,       r_h = rsqrt(mean_d h^2 + eps_norm),    x = gamma h r_h

The kernels never write h. Forward: read o and p, write x (and three floats per token). Unfused,
XLA writes h, reads it back for the norm, and its backward goes through h again.

The op also returns p itself, so that the caller's next use of p (the next partial sum) takes it
from here and dp_next, that use's gradient, reaches the backward kernel, which adds it in.
Given the previous sublayer's output y as well, the forward forms p = p_prev + y itself (reads
p_prev and y, writes p): one pass fewer than an XLA add that writes p and a kernel that reads it
back. p_prev and y then both get dp.

Backward, with g = dx * gamma (per token, sums over the D features):
    dgamma = sum_tokens dx h r_h
    dh     = r_h g - r_h^3 (g . h / D) h
    dsigma = dh . (o - p) = r_h g . (o - p) - r_h^3 (g . h / D) h . (o - p)
    dlse   = dsigma sigma (1 - sigma),    ds_p = -dlse
    do     = sigma dh
    dp     = dp_next + (1 - sigma) dh + ds_p r_p (q - (s_p r_p / D) p)
    dq     = sum_tokens ds_p r_p p
Each kernel holds a tile of whole rows in registers: every input is read once and every output
written once.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.attnres.settings import MergeNormSettings
from kernels_pallas.common import (
  compiler_params,
  defvjp_with_symbolic_zeros,
  dense,
  feature_chunk,
  is_zero,
  pad_rows,
  round_up,
)

F32 = jnp.float32


def _sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def _rowsum(*terms):
  """Per-row sum over the feature chunks of the elementwise product of the chunk lists."""
  total = None
  for parts in zip(*terms):
    prod = parts[0]
    for x in parts[1:]:
      prod = prod * x
    total = jnp.sum(prod, axis=1) if total is None else total + jnp.sum(prod, axis=1)
  return total


def _load(ref, rows, chunks):
  """A tile's whole rows as a list of float32 [bt, dc] feature chunks (held in registers)."""
  return [ref[rows, c].astype(F32) for c in chunks]


def _vector(ref, chunks):
  return [ref[c][None, :] for c in chunks]


def _fwd_kernel(*refs, dc, eps, norm_eps, add):
  """add: p arrives as two refs, the previous partial sum and the sublayer output y to add to it,
  and the sum p (rounded to their dtype, as an XLA add would store it) is written out too."""
  o_ref, p_ref = refs[:2]
  y_ref = refs[2] if add else None
  lse_ref, q_ref, gamma_ref, x_ref, stats_ref = refs[2 + add : 7 + add]
  bt, d = p_ref.shape
  chunks = [pl.ds(c, dc) for c in range(0, d, dc)]
  rows = pl.ds(0, bt)
  o, p = _load(o_ref, rows, chunks), _load(p_ref, rows, chunks)
  if add:
    p_out = refs[7 + add]
    p = [(pc + yc).astype(p_out.dtype) for pc, yc in zip(p, _load(y_ref, rows, chunks))]
    for c, pc in zip(chunks, p):
      p_out[:, c] = pc
    p = [pc.astype(F32) for pc in p]
  r_p = jax.lax.rsqrt(_rowsum(p, p) / d + eps)
  s_p = _rowsum(p, _vector(q_ref, chunks)) * r_p
  sig = _sigmoid(lse_ref[...] - s_p)[:, None]
  h = [sig * oc + (1 - sig) * pc for oc, pc in zip(o, p)]
  r_h = jax.lax.rsqrt(_rowsum(h, h) / d + norm_eps)
  for c, hc, gc in zip(chunks, h, _vector(gamma_ref, chunks)):
    x_ref[:, c] = (hc * r_h[:, None] * gc).astype(x_ref.dtype)
  stats_ref[0, :] = s_p
  stats_ref[1, :] = r_p
  stats_ref[2, :] = r_h


def _bwd_kernel(*refs, bt, tiles_per_program, dc, accumulate):
  """`tiles_per_program` tiles of bt rows; dq and dgamma accumulate per row in registers and are
  summed over rows once, at the end (this program's partials, summed over programs after).
  accumulate: a dp_next ref follows dx."""
  dx_ref, dp_in_ref = refs[0], (refs[1] if accumulate else None)
  (o_ref, p_ref, lse_ref, stats_ref, q_ref, gamma_ref, do_ref, dp_ref, dlse_ref, dq_ref, dgamma_ref) = refs[
    1 + accumulate :
  ]
  d = p_ref.shape[1]
  chunks = [pl.ds(c, dc) for c in range(0, d, dc)]
  q, gamma = _vector(q_ref, chunks), _vector(gamma_ref, chunks)

  def tile(t, acc):
    rows = pl.ds(t * bt, bt)
    s_p, r_p, r_h = stats_ref[0, rows], stats_ref[1, rows], stats_ref[2, rows]
    sigma = _sigmoid(lse_ref[rows] - s_p)
    sig = sigma[:, None]
    o, p, dx = _load(o_ref, rows, chunks), _load(p_ref, rows, chunks), _load(dx_ref, rows, chunks)
    h = [sig * oc + (1 - sig) * pc for oc, pc in zip(o, p)]
    g = [xc * gc for xc, gc in zip(dx, gamma)]
    diff = [oc - pc for oc, pc in zip(o, p)]
    k = r_h * r_h * r_h * _rowsum(g, h) / d  # dh = r_h g - k h
    dlse = (r_h * _rowsum(g, diff) - k * _rowsum(h, diff)) * sigma * (1 - sigma)
    dlse_ref[rows] = dlse
    coef = (-dlse * r_p)[:, None]  # ds_p r_p
    shrink = (s_p * r_p / d)[:, None]
    k, r_h = k[:, None], r_h[:, None]
    dq_acc, dgamma_acc = [], []
    for i, c in enumerate(chunks):
      dh = r_h * g[i] - k * h[i]
      do_ref[rows, c] = (sig * dh).astype(do_ref.dtype)
      dp = (1 - sig) * dh + coef * (q[i] - shrink * p[i])
      if accumulate:
        dp += dp_in_ref[rows, c].astype(F32)
      dp_ref[rows, c] = dp.astype(dp_ref.dtype)
      dq_acc.append(acc[0][i] + coef * p[i])
      dgamma_acc.append(acc[1][i] + dx[i] * h[i] * r_h)
    return tuple(dq_acc), tuple(dgamma_acc)

  zero = tuple(jnp.zeros((bt, dc), F32) for _ in chunks)
  dq_acc, dgamma_acc = jax.lax.fori_loop(0, tiles_per_program, tile, (zero, zero))
  for c, dq_c, dg_c in zip(chunks, dq_acc, dgamma_acc):
    dq_ref[c] = jnp.sum(dq_c, axis=0)
    dgamma_ref[c] = jnp.sum(dg_c, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _merge_norm(o, lse, p, addends, q, gamma, eps, norm_eps, dtype, settings, interpret):
  return _merge_norm_fwd(o, lse, p, addends, q, gamma, eps, norm_eps, dtype, settings, interpret)[0]


def _merge_norm_fwd(o, lse, p, addends, q, gamma, eps, norm_eps, dtype, settings, interpret):
  """addends: () or (y,), y to be added to p first (then the partial sum returned is p + y)."""
  m, d = p.shape
  bt, add = settings.bt, len(addends)
  rows = pl.BlockSpec((bt, d), lambda t: (t, 0))
  vector = pl.BlockSpec((d,), lambda t: (0,))
  x, stats, *p_sum = pl.pallas_call(
    functools.partial(_fwd_kernel, dc=feature_chunk(d, settings.dc), eps=eps, norm_eps=norm_eps, add=add),
    grid=(m // bt,),
    in_specs=[rows] * (2 + add) + [pl.BlockSpec((bt,), lambda t: (t,)), vector, vector],
    out_specs=[rows, pl.BlockSpec((3, bt), lambda t: (0, t))] + [rows] * add,
    out_shape=[jax.ShapeDtypeStruct((m, d), dtype), jax.ShapeDtypeStruct((3, m), F32)]
    + [jax.ShapeDtypeStruct((m, d), p.dtype)] * add,
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='attnres_merge_norm',
  )(o, p, *addends, lse, q, gamma)
  p = p_sum[0] if add else p
  return (x, p), (o, lse, p, q, gamma, stats, (None,) * add)


def _merge_norm_bwd(eps, norm_eps, dtype, settings, interpret, res, cotangents):
  del eps, norm_eps
  o, lse, p, q, gamma, stats, addends = res
  m, d = p.shape
  dx, dp_in = dense(cotangents[0], (m, d), dtype), cotangents[1]
  # No later use of the partial sum (the last consumer's): nothing to add, no zeros to read.
  dp_in = [] if is_zero(dp_in) else [dp_in]
  bt, g = settings.bt, settings.groups
  rows = pl.BlockSpec((bt * g, d), lambda t: (t, 0))
  vector = pl.BlockSpec((d,), lambda t: (0,))
  partial = pl.BlockSpec((None, d), lambda t: (t, 0))
  programs = m // (bt * g)
  do, dp, dlse, dq_parts, dgamma_parts = pl.pallas_call(
    functools.partial(
      _bwd_kernel, bt=bt, tiles_per_program=g, dc=feature_chunk(d, settings.dc), accumulate=bool(dp_in)
    ),
    grid=(programs,),
    in_specs=[rows] * (3 + len(dp_in))
    + [pl.BlockSpec((bt * g,), lambda t: (t,)), pl.BlockSpec((3, bt * g), lambda t: (0, t)), vector, vector],
    out_specs=[rows, rows, pl.BlockSpec((bt * g,), lambda t: (t,)), partial, partial],
    out_shape=[
      jax.ShapeDtypeStruct((m, d), o.dtype),
      jax.ShapeDtypeStruct((m, d), p.dtype),
      jax.ShapeDtypeStruct((m,), F32),
    ]
    + [jax.ShapeDtypeStruct((programs, d), F32)] * 2,
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='attnres_merge_norm_bwd',
  )(dx, *dp_in, o, p, lse, stats, q, gamma)
  # p = p_prev + y: both get p's gradient.
  return (do, dlse, dp, tuple(dp for _ in addends), jnp.sum(dq_parts, axis=0), jnp.sum(dgamma_parts, axis=0))


defvjp_with_symbolic_zeros(_merge_norm, _merge_norm_fwd, _merge_norm_bwd, num_diff_args=6)


def merge_norm(
  o,
  lse,
  partial,
  query,
  scale,
  *,
  eps: float,
  norm_eps: float,
  dtype,
  addend=None,
  settings=None,
  interpret: bool = False,
):
  """o, partial [..., D] (one dtype), lse [...], query and scale [D] -> (x [..., D] in `dtype`,
  partial): x = scale * rms_normalise(h, norm_eps), h = sigma o + (1 - sigma) partial (see the
  module docstring). With `addend` y (like partial), the partial sum is partial + y, formed in
  the kernel (rounded to partial's dtype) instead of by a separate XLA add that writes it and
  the kernel reads it back. The partial sum comes back (partial, or partial + y) so that the
  caller's later uses of it (the next partial sum) go through this op: the backward kernel then
  adds their gradient to its own, where otherwise XLA would add the two in a separate pass.
  settings: the kernels' MergeNormSettings (settings.py; None: the defaults). Differentiable in o,
  lse, partial, addend, query and scale."""
  shape = partial.shape
  if (
    o.shape != shape
    or o.dtype != partial.dtype
    or lse.shape != shape[:-1]
    or query.shape != shape[-1:]
    or scale.shape != shape[-1:]
    or (addend is not None and (addend.shape, addend.dtype) != (shape, partial.dtype))
  ):
    raise ValueError(
      f'attnres merge_norm: o, partial (and addend) must be [..., D] of one dtype, '
      f'lse [...], query and scale [D]; got o {o.shape} {o.dtype}, partial {shape} '
      f'{partial.dtype}, addend {None if addend is None else (addend.shape, addend.dtype)}, '
      f'lse {lse.shape}, query {query.shape}, scale {scale.shape}'
    )
  settings = MergeNormSettings() if settings is None else settings
  if not isinstance(settings, MergeNormSettings):
    raise TypeError(
      f'attnres merge_norm: settings must be a MergeNormSettings (kernels_pallas/attnres/'
      f'settings.py) or None, got {type(settings).__name__}'
    )
  return _merge_norm_flat(
    o,
    lse,
    partial,
    addend,
    query,
    scale,
    eps=float(eps),
    norm_eps=float(norm_eps),
    dtype=jnp.dtype(dtype),
    settings=settings,
    interpret=bool(interpret),
  )


@functools.partial(jax.jit, static_argnames=('eps', 'norm_eps', 'dtype', 'settings', 'interpret'))
def _merge_norm_flat(o, lse, partial, addend, query, scale, *, eps, norm_eps, dtype, settings, interpret):
  """merge_norm after its checks, under one jax.jit shared by every call of the same shapes and
  settings (kernels_pallas/__init__.py)."""
  shape = partial.shape
  d, m = shape[-1], math.prod(shape[:-1])
  m_pad = round_up(m, settings.bt * settings.groups)
  # Padded with ones (a zero row would give an infinite rsqrt for eps = 0); the padded rows'
  # outputs are dropped, so they add nothing to any gradient.
  flat = lambda a: pad_rows(a.reshape(m, d), m_pad, value=1)
  lse = jnp.pad(lse.reshape(m).astype(F32), (0, m_pad - m))
  addends = () if addend is None else (flat(addend),)
  x, p = _merge_norm(
    flat(o),
    lse,
    flat(partial),
    addends,
    query.astype(F32),
    scale.astype(F32),
    eps,
    norm_eps,
    dtype,
    settings,
    interpret,
  )
  return x[:m].reshape(shape), p[:m].reshape(shape)
