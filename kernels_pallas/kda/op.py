"""KDA in the chunkwise form through the Pallas kernels of this folder, forward and backward.

    o, s_final = kda_pallas(q, k, v, g, beta, s0, scale=..., settings=KdaSettings(...), interpret=...)

Forward: the within-chunk cumulative log-decay G (cumsum.py); the diagonal 16 x 16 score blocks
(every token, or every sub-chunk, in parallel); the scores aqk and N (every 16-row sub-chunk of every chunk in
parallel); T = (I + N)^-1 (wy_inverse, every chunk); qg, kg, w, u from T (wy_apply, every
chunk); state_fwd (the chunks in order, the state on chip: o and the final state). The backward
keeps the inputs, aqk and T (each [B, T, H, C] in the dot dtype): it recomputes G and wy_apply's
outputs, reruns the state pass writing the states h and v_new instead of o, runs state_bwd (the
chunks in reverse), forms the per-chunk cotangents and the UT transform's transpose
(cotangents.py, one program per chunk), runs the scores backward kernels (the diagonal blocks
token by token or sub-chunk by sub-chunk, then every sub-chunk, adding the UT transform's
gradients) and the reverse cumulative sum that turns dG into dg. Given the decay gate's
parameters (a_log, dt_bias), both cumulative sums take the gate's pre-activation instead of g and
evaluate the gate and its derivative themselves. Every kernel call takes the family's settings
(settings.py: warps, stages, tiles, switches) as an argument. See README.md in this folder.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from kernels_pallas.common import power_of_two_divisor
from kernels_pallas.kda.blocks import F32, SUB, any_steep
from kernels_pallas.kda.cotangents import chunk_cotangents_kernel, wy_bwd_kernel
from kernels_pallas.kda.cumsum import chunk_cumsum_kernel, gated_cumsum_kernel, gated_reverse_cumsum_kernel
from kernels_pallas.kda.scores import diag_bwd_kernel, diag_fwd_kernel, scores_bwd_kernel, scores_fwd_kernel
from kernels_pallas.kda.settings import checked
from kernels_pallas.kda.state import state_bwd_kernel, state_fwd_kernel
from kernels_pallas.kda.wy import wy_apply_kernel, wy_inverse_kernel

# SAVED: the checkpoint_name of the residuals worth keeping (aqk, T), defined with the op
from kimijax.ops.kda import SAVED, log_decay_from_pre_activation, reset_log_decay

CHUNK = 64


def chunk_len(t: int) -> int:
  """Chunk length for T tokens: 64, or the power of two >= T (at least 16) for shorter inputs."""
  return min(CHUNK, max(SUB, pl.next_power_of_2(t)))


# ----------------------------------------------------------------------------- block specs


def _sub_spec(d, nb, sliced=False):
  """A 16-row sub-chunk of [B, T, H, d] (d None: of [B, T, H]), grid (b, h, chunk, sub-chunk[,
  feature slice]); sliced: the block is feature slice f of width d."""
  if d is None:
    return pl.BlockSpec((None, SUB, None), lambda bi, hi, n, a, *f: (bi, n * nb + a, hi))
  return pl.BlockSpec((None, SUB, None, d), lambda bi, hi, n, a, *f: (bi, n * nb + a, hi, f[0] if sliced else 0))


def _chunk_spec(d, c, sliced=False):
  """One chunk of [B, T, H, d] (d None: of [B, T, H]), grid (b, h, chunk[, sub-chunk, feature
  slice]); sliced: the block is feature slice f (the last grid index) of width d."""
  if d is None:
    return pl.BlockSpec((None, c, None), lambda bi, hi, n, *_: (bi, n, hi))
  return pl.BlockSpec((None, c, None, d), lambda bi, hi, n, *rest: (bi, n, hi, rest[-1] if sliced else 0))


def _chunk_state_spec(dk, dv):
  """Chunk n's [K, V] state of the state passes' [B, H, N*K, V] layout (h, dh), grid (b, h, chunk)."""
  return pl.BlockSpec((None, None, dk, dv), lambda bi, hi, n: (bi, hi, n, 0))


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, dtype)


def _cumsum_layout(x, c, reverse, settings):
  """(grid, chunk spec, chunk-row spec, head-row spec, compiler params) of the cumulative-sum
  kernels over x [B, T, H, K]: one program per chunk and slice of settings.features_cumsum
  features (features_reverse_cumsum for the reverse sums); the sums run down each feature's
  column, so slices are independent."""
  b, t, h, dk = x.shape
  kernel = 'reverse_cumsum' if reverse else 'cumsum'
  kb = power_of_two_divisor(dk, getattr(settings, 'features_' + kernel))
  return (
    (b, h, t // c, dk // kb),
    _chunk_spec(kb, c, sliced=True),
    pl.BlockSpec((None, None, None, kb), lambda bi, hi, n, f: (bi, n, hi, f)),
    pl.BlockSpec((None, kb), lambda bi, hi, n, f: (hi, f)),
    settings.params(kernel),
  )


def chunk_cumsum(x, c, *, settings, reverse=False, add=None, interpret=False):
  """Within-chunk inclusive cumulative sum of x [B, T, H, K] (T a multiple of c), float32;
  reverse: the sum from each row to the chunk's end; add [B, T/c, H, K]: a row added to every
  row of its chunk's result."""
  grid, spec, row, _, params = _cumsum_layout(x, c, reverse, settings)
  in_specs, args = [spec], [x]
  if add is not None:
    in_specs.append(row)
    args.append(add)
  return pl.pallas_call(
    functools.partial(chunk_cumsum_kernel, reverse=reverse),
    grid=grid,
    in_specs=in_specs,
    out_specs=spec,
    out_shape=_sds(x.shape, F32),
    compiler_params=params,
    interpret=interpret,
    name='kda_chunk_cumsum',
  )(*args)


def _reset_input(resets, c):
  """(in_specs, args) the gated cumulative sums add for document resets [B, T] int32 (None: none):
  one chunk of the row per program."""
  if resets is None:
    return [], []
  return [pl.BlockSpec((None, c), lambda bi, hi, n, f: (bi, n))], [resets]


def gated_cumsum(f, a_hk, bias_hk, c, *, lower_bound, t_valid, settings, interpret, resets=None):
  """G [B, T, H, K] float32: the within-chunk cumulative sum of the gate's log-decay from its
  pre-activation f [B, T, H, K] (kimijax.ops.kda.gate_log_decay; a_hk = exp(A_log) and bias_hk = dt_bias,
  [H, K] float32); rows from t_valid on (None: none) decay by nothing; rows where resets [B, T]
  int32 (None: none) is nonzero decay by RESET_LOG_DECAY (the state starts from zero there)."""
  grid, spec, _, head, params = _cumsum_layout(f, c, False, settings)
  kernel = functools.partial(gated_cumsum_kernel, lower_bound=lower_bound, t_valid=t_valid)
  reset_specs, reset_args = _reset_input(resets, c)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[spec, head, head] + reset_specs,
    out_specs=spec,
    out_shape=_sds(f.shape, F32),
    compiler_params=params,
    interpret=interpret,
    name='kda_gated_cumsum',
  )(f, a_hk, bias_hk, *reset_args)


def gated_reverse_cumsum(dgc, add, f, a_hk, bias_hk, c, *, lower_bound, t_valid, settings, interpret, resets=None):
  """The gated cumulative sum's backward from dG [B, T, H, K] and the chunk-end rows add [B, N,
  H, K]: (df in f's dtype, and per chunk [B, N, H, K] float32 the column sums of df and of dg
  dg/dA_log, whose sums are the gradients of dt_bias and A_log); rows where resets is nonzero
  pass no gradient to the gate."""
  b, t, h, dk = f.shape
  grid, spec, row, head, params = _cumsum_layout(f, c, True, settings)
  kernel = functools.partial(gated_reverse_cumsum_kernel, lower_bound=lower_bound, t_valid=t_valid)
  per_chunk = _sds((b, t // c, h, dk), F32)
  reset_specs, reset_args = _reset_input(resets, c)
  return pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=[spec, row, spec, head, head] + reset_specs,
    out_specs=[spec, row, row],
    out_shape=[_sds(f.shape, f.dtype), per_chunk, per_chunk],
    compiler_params=params,
    interpret=interpret,
    name='kda_gated_reverse_cumsum',
  )(dgc, add, f, a_hk, bias_hk, *reset_args)


# ----------------------------------------------------------------------------- kernel calls


def _heads_per_program(h, key, settings):
  """Heads per program of a token-parallel kernel: at most the setting `key`, dividing h."""
  return power_of_two_divisor(h, getattr(settings, key))


def _token_specs(hb):
  """Block specs of the token-parallel kernels, grid (b, token, head group): token(d) is token t
  of [B, T, H, d], sub(d) its 16-token sub-chunk (d None: of [B, T, H])."""

  def token(d):
    if d is None:
      return pl.BlockSpec((None, 1, hb), lambda bi, ti, hi: (bi, ti, hi))
    return pl.BlockSpec((None, 1, hb, d), lambda bi, ti, hi: (bi, ti, hi, 0))

  def sub(d):
    if d is None:
      return pl.BlockSpec((None, SUB, hb), lambda bi, ti, hi: (bi, ti // SUB, hi))
    return pl.BlockSpec((None, SUB, hb, d), lambda bi, ti, hi: (bi, ti // SUB, hi, 0))

  return token, sub


def _score_diag_specs(hb, c):
  """The same grid's blocks of a [B, T, H, C] score array: token t's row and its sub-chunk's
  rows, the columns of t's own sub-chunk (its diagonal block)."""
  cols = lambda ti: (ti % c) // SUB
  return (
    pl.BlockSpec((None, 1, hb, SUB), lambda bi, ti, hi: (bi, ti, hi, cols(ti))),
    pl.BlockSpec((None, SUB, hb, SUB), lambda bi, ti, hi: (bi, ti // SUB, hi, cols(ti))),
  )


def diag_fwd(q, k, gc, beta, *, scale, settings, interpret):
  """The diagonal 16 x 16 blocks of aqk (q's dtype) and n (float32), [B, T, H, 16]: row r of a
  block at row r; one program per token. Written only for steep sub-chunks (not
  blocks.diagonal_by_matmul), the only ones scores_fwd reads."""
  b, t, h, dk = q.shape
  out_shape = [_sds((b, t, h, SUB), q.dtype), _sds((b, t, h, SUB), F32)]
  hb = _heads_per_program(h, 'heads_diag', settings)
  token, sub = _token_specs(hb)
  return pl.pallas_call(
    functools.partial(diag_fwd_kernel, scale=scale),
    grid=(b, t, h // hb),
    in_specs=[token(dk), token(dk), token(dk), token(None), sub(dk), sub(dk)],
    out_specs=[token(SUB), token(SUB)],
    out_shape=out_shape,
    compiler_params=settings.params('diag'),
    interpret=interpret,
    name='kda_diag_fwd',
  )(q, k, gc, beta, k, gc)


def diag_bwd(q, k, gc, beta, daqk, dn, *, scale, c, settings, interpret):
  """(qrow, rrow, ccol) [B, T, H, K] float32: the diagonal blocks' terms of the scores backward
  (scores.diag_bwd_kernel), one program per token; written, and read by scores_bwd, only for
  steep sub-chunks."""
  b, t, h, dk = q.shape
  hb = _heads_per_program(h, 'heads_diag_bwd', settings)
  token, sub = _token_specs(hb)
  token_diag, sub_diag = _score_diag_specs(hb, c)
  return pl.pallas_call(
    functools.partial(diag_bwd_kernel, scale=scale),
    grid=(b, t, h // hb),
    in_specs=[token(dk), token_diag, token_diag, sub(dk), sub(dk), sub(dk), sub(None), sub_diag, sub_diag],
    out_specs=[token(dk)] * 3,
    out_shape=[_sds(q.shape, F32)] * 3,
    compiler_params=settings.params('diag_bwd'),
    interpret=interpret,
    name='kda_diag_bwd',
  )(gc, daqk, dn, q, k, gc, beta, daqk, dn)


def _flat_or_steep(gc, flat, steep, settings):
  """flat() when settings.flat_branch is on and no sub-chunk of gc is steep, else steep()."""
  if not settings.flat_branch:
    return steep()
  return jax.lax.cond(any_steep(gc), steep, flat)


def scores_fwd(q, k, gc, beta, *, scale, c, settings, interpret):
  """(aqk [B, T, H, C] in q's dtype, n [B, T, H, C] float32)."""
  b, t, h, dk = q.shape
  nb = c // SUB

  def call(*diag):
    kernel = functools.partial(scores_fwd_kernel, scale=scale, nb=nb, dot_dtype=q.dtype, pairwise=bool(diag))
    return pl.pallas_call(
      kernel,
      grid=(b, h, t // c, nb),
      in_specs=[
        _sub_spec(dk, nb),
        _sub_spec(dk, nb),
        _sub_spec(dk, nb),
        _sub_spec(None, nb),
        _chunk_spec(dk, c),
        _chunk_spec(dk, c),
      ]
      + [_sub_spec(SUB, nb)] * len(diag),
      out_specs=[_sub_spec(c, nb), _sub_spec(c, nb)],
      out_shape=[_sds((b, t, h, c), q.dtype), _sds((b, t, h, c), F32)],
      compiler_params=settings.params('scores'),
      interpret=interpret,
      name='kda_scores_fwd',
    )(q, k, gc, beta, k, gc, *diag)

  return _flat_or_steep(
    gc, call, lambda: call(*diag_fwd(q, k, gc, beta, scale=scale, settings=settings, interpret=interpret)), settings
  )


def wy_inverse(n, *, c, dtype, settings, interpret):
  """T = (I + N)^-1 per chunk, [B, T, H, C] in dtype (the dot dtype), zero above the diagonal."""
  b, t, h, _ = n.shape
  spec = _chunk_spec(c, c)
  return pl.pallas_call(
    functools.partial(wy_inverse_kernel, nb=c // SUB),
    grid=(b, h, t // c),
    in_specs=[spec],
    out_specs=spec,
    out_shape=_sds(n.shape, dtype),
    compiler_params=settings.params('wy'),
    interpret=interpret,
    name='kda_wy_inverse',
  )(n)


def wy_apply(t_inv, q, k, v, gc, beta, *, scale, c, settings, interpret):
  """(qg, kg, w [B, T, H, K], u [B, T, H, V]) in q's dtype, from T (wy_inverse); one program per
  chunk."""
  b, t, h, dk = q.shape
  spec = lambda d: _chunk_spec(d, c)
  kernel = functools.partial(wy_apply_kernel, scale=scale, dot_dtype=q.dtype)
  return pl.pallas_call(
    kernel,
    grid=(b, h, t // c),
    in_specs=[spec(c), spec(dk), spec(dk), spec(v.shape[-1]), spec(dk), spec(None)],
    out_specs=[spec(dk), spec(dk), spec(dk), spec(v.shape[-1])],
    out_shape=[_sds(q.shape, q.dtype)] * 3 + [_sds(v.shape, q.dtype)],
    compiler_params=settings.params('apply'),
    interpret=interpret,
    name='kda_wy_apply',
  )(t_inv, q, k, v, gc, beta)


def _state_specs(t, dk, bv, c):
  whole = lambda d: pl.BlockSpec((None, t, None, d), lambda bi, hi, j: (bi, 0, hi, 0))
  cols = pl.BlockSpec((None, t, None, bv), lambda bi, hi, j: (bi, 0, hi, j))
  state = pl.BlockSpec((None, None, dk, bv), lambda bi, hi, j: (bi, hi, 0, j))
  per_chunk = pl.BlockSpec((None, None, (t // c) * dk, bv), lambda bi, hi, j: (bi, hi, 0, j))
  return whole, cols, state, per_chunk


def state_fwd(qg, kg, w, u, aqk, gc, s0, *, c, out_dtype, with_h, settings, interpret):
  """(o [B, T, H, V] in out_dtype, s_final [B, H, K, V] float32); with_h (for the backward):
  (v_new [B, T, H, V], s_final, h [B, H, N*K, V]), v_new and h in the dot dtype, no o."""
  b, t, h, dk = qg.shape
  dv = u.shape[-1]
  bv = settings.state_value_block(b, h, dv)
  whole, cols, state, per_chunk = _state_specs(t, dk, bv, c)
  out_specs = [cols, state] + ([per_chunk] if with_h else [])
  out_shape = [_sds((b, t, h, dv), qg.dtype if with_h else out_dtype), _sds((b, h, dk, dv), F32)]
  if with_h:
    out_shape.append(_sds((b, h, (t // c) * dk, dv), qg.dtype))
  kernel = functools.partial(state_fwd_kernel, nt=t // c, c=c, dot_dtype=qg.dtype)
  return pl.pallas_call(
    kernel,
    grid=(b, h, dv // bv),
    in_specs=[whole(dk), whole(dk), whole(dk), cols, whole(c), whole(dk), state],
    out_specs=out_specs,
    out_shape=out_shape,
    compiler_params=settings.params('state', settings.state_stages('state_fwd', b, h, dk, dv, c, qg.dtype.itemsize)),
    interpret=interpret,
    name='kda_state_fwd',
  )(qg, kg, w, u, aqk, gc, s0)


def state_bwd(qg, kg, w, aqk, gc, do, ds_final, *, c, settings, interpret):
  """(ds0 [B, H, K, V] float32, dh [B, H, N*K, V] in the dot dtype, dv_new [B, T, H, V] float32)."""
  b, t, h, dk = qg.shape
  dv = do.shape[-1]
  bv = settings.state_value_block(b, h, dv)
  whole, cols, state, per_chunk = _state_specs(t, dk, bv, c)
  kernel = functools.partial(state_bwd_kernel, nt=t // c, c=c, dot_dtype=qg.dtype)
  return pl.pallas_call(
    kernel,
    grid=(b, h, dv // bv),
    in_specs=[whole(dk), whole(dk), whole(dk), whole(c), whole(dk), cols, state],
    out_specs=[state, per_chunk, cols],
    out_shape=[_sds((b, h, dk, dv), F32), _sds((b, h, (t // c) * dk, dv), qg.dtype), _sds((b, t, h, dv), F32)],
    compiler_params=settings.params('state', settings.state_stages('state_bwd', b, h, dk, dv, c, qg.dtype.itemsize)),
    interpret=interpret,
    name='kda_state_bwd',
  )(qg, kg, w, aqk, gc, do, ds_final)


def chunk_cotangents(hs, dh, do, dv_new, v_new, *, c, settings, interpret):
  """(dqg, dkg, dw) [B, T, H, K] in the dot dtype, daqk [B, T, H, C] float32, ddecay [B, N, H, K]
  float32, from h and dh [B, H, N*K, V] (the state passes' layout)."""
  b, t, h, dv = do.shape
  dk = hs.shape[2] // (t // c)
  spec = lambda d: _chunk_spec(d, c)
  state = _chunk_state_spec(dk, dv)
  decay = pl.BlockSpec((None, None, None, dk), lambda bi, hi, n: (bi, n, hi, 0))
  dt = hs.dtype
  return pl.pallas_call(
    functools.partial(chunk_cotangents_kernel, dot_dtype=dt),
    grid=(b, h, t // c),
    in_specs=[state, state, spec(dv), spec(dv), spec(dv)],
    out_specs=[spec(dk)] * 3 + [spec(c), decay],
    out_shape=[_sds((b, t, h, dk), dt)] * 3 + [_sds((b, t, h, c), F32), _sds((b, t // c, h, dk), F32)],
    compiler_params=settings.params('cotangents'),
    interpret=interpret,
    name='kda_chunk_cotangents',
  )(hs, dh, do, dv_new, v_new)


def wy_backward(t_inv, dw, dv_new, k, v, gc, beta, *, c, settings, interpret):
  """(dn [B, T, H, C], dk [B, T, H, K], dv [B, T, H, V] in v's dtype (final), dg [B, T, H, K], dbeta
  [B, T, H]), float32 but dv: the gradients through w and u (cotangents.wy_bwd_kernel)."""
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  spec = lambda d: _chunk_spec(d, c)
  return pl.pallas_call(
    functools.partial(wy_bwd_kernel, dot_dtype=t_inv.dtype),
    grid=(b, h, t // c),
    in_specs=[spec(c), spec(dk), spec(dv), spec(dk), spec(dv), spec(dk), spec(None)],
    out_specs=[spec(c), spec(dk), spec(dv), spec(dk), spec(None)],
    out_shape=[
      _sds((b, t, h, c), F32),
      _sds(k.shape, F32),
      _sds(v.shape, v.dtype),
      _sds(k.shape, F32),
      _sds((b, t, h), F32),
    ],
    compiler_params=settings.params('wy_bwd'),
    interpret=interpret,
    name='kda_wy_bwd',
  )(t_inv, dw, dv_new, k, v, gc, beta)


def scores_bwd(q, k, gc, beta, dqg, dkg, daqk, dn, dk_wy, dg_wy, dbeta_wy, *, scale, c, settings, interpret):
  """(dq in q's dtype, dk in k's dtype, dg float32, dbeta float32, dlast): the gradients through
  the scores and the direct terms plus the UT transform's (dk_wy, dg_wy, dbeta_wy: added in the
  kernel, so dq and dk are final); dg of G; dlast [B, N * C/16, H, K] per sub-chunk. One program
  per sub-chunk and slice of settings.features_bwd features."""
  b, t, h, dk = q.shape
  nb = c // SUB
  bk = min(settings.features_bwd, dk)
  nk = dk // bk
  sub, whole = (lambda d: _sub_spec(d, nb)), (lambda d: _chunk_spec(d, c))
  sub_f, whole_f = _sub_spec(bk, nb, sliced=True), _chunk_spec(bk, c, sliced=True)

  def call(*diag_terms):
    kernel = functools.partial(scores_bwd_kernel, scale=scale, nb=nb, dot_dtype=q.dtype, pairwise=bool(diag_terms))
    return pl.pallas_call(
      kernel,
      grid=(b, h, t // c, nb, nk),
      in_specs=[
        sub_f,
        sub_f,
        sub_f,
        sub(None),
        sub_f,
        sub_f,
        sub(c),
        sub(c),
        whole_f,
        whole_f,
        whole_f,
        whole(None),
        whole(c),
        whole(c),
      ]
      + [sub_f] * len(diag_terms)
      + [sub_f, sub_f, sub(None)],
      out_specs=[
        sub_f,
        sub_f,
        sub_f,
        pl.BlockSpec((None, SUB, None, None), lambda bi, hi, n, a, f: (bi, n * nb + a, hi, f)),
        pl.BlockSpec((None, 1, None, bk), lambda bi, hi, n, a, f: (bi, n * nb + a, hi, f)),
      ],
      out_shape=[
        _sds(q.shape, q.dtype),
        _sds(k.shape, k.dtype),
        _sds(q.shape, F32),
        _sds((b, t, h, nk), F32),
        _sds((b, (t // c) * nb, h, dk), F32),
      ],
      compiler_params=settings.params('scores_bwd'),
      interpret=interpret,
      name='kda_scores_bwd',
    )(q, k, gc, beta, dqg, dkg, daqk, dn, q, k, gc, beta, daqk, dn, *diag_terms, dk_wy, dg_wy, dbeta_wy)

  dq, dk_, dg, dbeta, dlast = _flat_or_steep(
    gc,
    call,
    lambda: call(*diag_bwd(q, k, gc, beta, daqk, dn, scale=scale, c=c, settings=settings, interpret=interpret)),
    settings,
  )
  return dq, dk_, dg, jnp.sum(dbeta, axis=-1), dlast


# ----------------------------------------------------------------------------- the op


def _gate_rows(gate_params):
  """(exp(A_log), dt_bias) as [H, K] float32 rows."""
  a_log, dt_bias = gate_params
  return jnp.broadcast_to(jnp.exp(a_log)[:, None], dt_bias.shape), dt_bias


def _cumulative_log_decay(g, gate_params, resets, gate, c, settings, interpret):
  """G from g (gate None) or from the gate's pre-activation g and gate_params (a_log, dt_bias),
  with the document resets (only with the gate: without it they are in g already)."""
  if gate is None:
    return chunk_cumsum(g, c, settings=settings, interpret=interpret)
  lower_bound, t_valid = gate
  return gated_cumsum(
    g,
    *_gate_rows(gate_params),
    c,
    lower_bound=lower_bound,
    t_valid=t_valid,
    settings=settings,
    interpret=interpret,
    resets=resets,
  )


def _forward(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings):
  """(o, s_final) and the tensors the backward keeps besides the inputs: aqk and T."""
  c = chunk_len(q.shape[1])
  kw = dict(settings=settings, interpret=interpret)
  gc = _cumulative_log_decay(g, gate_params, resets, gate, c, **kw)
  aqk, n = scores_fwd(q, k, gc, beta, scale=scale, c=c, **kw)
  t_inv = wy_inverse(n, c=c, dtype=q.dtype, **kw)
  qg, kg, w, u = wy_apply(t_inv, q, k, v, gc, beta, scale=scale, c=c, **kw)
  o, s_final = state_fwd(qg, kg, w, u, aqk, gc, s0, c=c, out_dtype=v.dtype, with_h=False, **kw)
  return (o, s_final), (aqk, t_inv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def kda_core(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings):
  """q, k [B, T, H, K] (the dot dtype), v [B, T, H, V], g [B, T, H, K] float32 log-decay, beta
  [B, T, H], s0 [B, H, K, V] float32; T a multiple of chunk_len(T). Returns (o, s_final).
  With gate = (lower_bound, t_valid) (static) and gate_params = (a_log [H], dt_bias [H, K])
  float32, g is instead the gate's pre-activation f (any float dtype), formed into the log-decay
  inside the cumulative-sum kernels; gate None: gate_params None. resets: None, or with the gate
  the document resets [B, T] int32 the cumulative-sum kernels apply (no gradient). settings:
  KdaSettings (static)."""
  return _forward(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings)[0]


def _core_fwd(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings):
  outs, saved = _forward(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings)
  return outs, (q, k, v, g, beta, s0, gate_params, resets) + tuple(checkpoint_name(x, SAVED) for x in saved)


def _chunk_view(x, c):
  """[B, T, H, *] -> [B, N, C, H, *] (a reshape)."""
  b, t = x.shape[:2]
  return x.reshape(b, t // c, c, *x.shape[2:])


def _core_bwd(scale, interpret, gate, settings, res, cotangents):
  q, k, v, g, beta, s0, gate_params, resets, aqk, t_inv = res
  do, ds_final = cotangents
  b, t, h, dk = q.shape
  c = chunk_len(t)
  nt = t // c
  kw = dict(settings=settings, interpret=interpret)
  gc = _cumulative_log_decay(g, gate_params, resets, gate, c, **kw)
  qg, kg, w, u = wy_apply(t_inv, q, k, v, gc, beta, scale=scale, c=c, **kw)
  v_new, _, hs = state_fwd(qg, kg, w, u, aqk, gc, s0, c=c, out_dtype=v.dtype, with_h=True, **kw)
  do = do.astype(v.dtype)
  ds0, dh, dv_new = state_bwd(qg, kg, w, aqk, gc, do, ds_final.astype(F32), c=c, **kw)
  dqg, dkg, dw, daqk, ddecay = chunk_cotangents(hs, dh, do, dv_new, v_new, c=c, **kw)
  dn, dk_wy, dv, dg_wy, dbeta_wy = wy_backward(t_inv, dw, dv_new, k, v, gc, beta, c=c, **kw)
  dq, dk_, dg_s, dbeta, dlast = scores_bwd(
    q, k, gc, beta, dqg, dkg, daqk, dn, dk_wy, dg_wy, dbeta_wy, scale=scale, c=c, **kw
  )
  g_end = _chunk_view(gc, c)[:, :, -1]  # G_C, [B, N, H, K]
  d_end = jnp.sum(dlast.reshape(b, nt, c // SUB, h, dk), axis=2) + ddecay * jnp.exp(g_end)
  # dg_i = sum over rows r >= i of the chunk of dG_r, plus G_C's gradient (every g of the chunk)
  if gate is None:
    dg = chunk_cumsum(dg_s, c, reverse=True, add=d_end, **kw).astype(g.dtype)
    d_gate = None
  else:  # then through the gate: df, and the sums that are d A_log and d dt_bias
    dg, dbias_rows, dalog_rows = gated_reverse_cumsum(
      dg_s, d_end, g, *_gate_rows(gate_params), c, lower_bound=gate[0], t_valid=gate[1], resets=resets, **kw
    )
    d_gate = (jnp.sum(dalog_rows, axis=(0, 1, 3)), jnp.sum(dbias_rows, axis=(0, 1)))
  return dq, dk_, dv, dg, dbeta.astype(beta.dtype), ds0, d_gate, None


kda_core.defvjp(_core_fwd, _core_bwd)


def kda_pallas(
  q,
  k,
  v,
  g,
  beta,
  initial_state=None,
  *,
  scale,
  a_log=None,
  dt_bias=None,
  gate_lower_bound=0.0,
  settings=None,
  interpret=False,
  resets=None,
):
  """KDA (docs/kda.md) through the Pallas kernels: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H].

  Any T (padded to a multiple of the chunk with tokens that neither decay nor write); K and V
  powers of two >= 16. q and k enter the dots in v's dtype when v is bf16 or float16, else in
  float32; g, the decays, states and accumulation are float32. Returns (o [B, T, H, V] in v's
  dtype, final state [B, H, K, V] float32). Differentiable in every input, initial_state included.
  With a_log [H] and dt_bias [H, K], g is the decay gate's pre-activation f (in its own dtype) and
  the log-decay is gate_log_decay(f + dt_bias, exp(a_log), gate_lower_bound) (kimijax.ops.kda),
  formed in the cumulative-sum kernels (settings.fused_gate) or by XLA; a_log and dt_bias get
  gradients. settings: the kernels' KdaSettings (None: the defaults). resets: None, or [B, T] bool,
  True where the state restarts from zero before the token's write (document masking,
  kimijax.ops.kda): the log-decay is RESET_LOG_DECAY there, set by XLA in g, or with the gate
  fused by the cumulative-sum kernels, and that token's g, f or gate gets no gradient from it.
  """
  dk, dv = q.shape[-1], v.shape[-1]
  for name, d in (('K', dk), ('V', dv)):
    if d < 16 or d & (d - 1):
      raise ValueError(
        f"kda impl='pallas': {name} = {d} must be a power of two >= 16 "
        f"(q {list(q.shape)}, v {list(v.shape)}); use impl='xla' for other sizes"
      )
  settings = checked(settings, 'kda')
  return _kda_pallas(
    q,
    k,
    v,
    g,
    beta,
    initial_state,
    a_log,
    dt_bias,
    None if resets is None else jnp.asarray(resets),
    scale=float(scale),
    gate_lower_bound=float(gate_lower_bound),
    interpret=bool(interpret),
    settings=settings,
  )


@functools.partial(jax.jit, static_argnames=('scale', 'gate_lower_bound', 'interpret', 'settings'))
def _kda_pallas(
  q, k, v, g, beta, initial_state, a_log, dt_bias, resets, *, scale, gate_lower_bound, interpret, settings
):
  """kda_pallas under one jax.jit: every layer's call with the same shapes and settings shares
  one trace, so a model's lowered module holds each kernel once (kernels_pallas/__init__.py)."""
  b, t, h, dk = q.shape
  dv = v.shape[-1]
  dot_dtype = v.dtype if v.dtype in (jnp.bfloat16, jnp.float16) else F32
  c = chunk_len(t)
  pad = -t % c
  time_pad = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)) if pad else x
  gate_params = gate = None
  if a_log is not None:
    a_log, dt_bias = a_log.astype(F32), dt_bias.astype(F32)
    if settings.fused_gate:
      gate_params, gate = (a_log, dt_bias), (gate_lower_bound, t if pad else None)
    else:
      g = log_decay_from_pre_activation(g, a_log, dt_bias, gate_lower_bound)
  if resets is not None and not gate:  # a g in XLA: the resets go into it there
    g, resets = reset_log_decay(g.astype(F32), resets), None
  elif resets is not None:  # the gated cumulative sums apply them
    resets = time_pad(resets.astype(jnp.int32))
  q, k, v = (time_pad(x.astype(dot_dtype)) for x in (q, k, v))
  g, beta = time_pad(g if gate else g.astype(F32)), time_pad(beta.astype(F32))
  s0 = jnp.zeros((b, h, dk, dv), F32) if initial_state is None else initial_state.astype(F32)
  o, s_final = kda_core(q, k, v, g, beta, s0, gate_params, resets, scale, interpret, gate, settings)
  return o[:, :t], s_final
