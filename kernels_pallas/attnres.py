"""Phase 1 of Block Attention Residuals (SPEC §4) as Pallas (Triton) kernels, forward and backward.

At the start of a block, the block's S consumers all attend over the same completed sources
v_1 .. v_n (the embedding and the block sums) with their own static queries q_j. Phase 1 does it
for all S at once, so each source is read a fixed number of times per block, not per consumer:

    s_ji = (q_j . v_i) * r_i,   r_i = rsqrt(mean_d v_i^2 + eps)      (per token, float32)
    lse_j = logsumexp_i s_ji,   o_j = sum_i exp(s_ji - lse_j) v_i

Each consumer later merges o_j with its block's partial sum (kimijax.ops.attnres.merge_partial,
or with its pre-norm fused, merge_norm in kernels_pallas/attnres_merge.py).

Kernels (M tokens, D features; the sources are [M, D] in any float dtype):
  _logits_kernel     reads each source once: r [n, M] and the query dots (q_j . v_i) r_i, as
                     [n, M, BF16_TERMS * S padded] (terms summed after the kernel)
  _combine_kernel    reads each source once, writes the S outputs o_j [M, D]
  _vdo_kernel        backward: g_ji = do_j . v_i from one read of each do_j and each source
  _grads_kernel      backward: dv_i (plus the gradient of the sources' later uses, which the
                     op passes through) and per-program partial dq_j from one more read of each
The softmax over n and the per-token backward coefficients are [n, S, M] arrays, computed in XLA
between the kernels. The backward maths (dL/ds_ji = alpha_ji (g_ji - do_j . o_j + dlse_j),
do_j . o_j = sum_i alpha_ji g_ji):
    dv_i = sum_j alpha_ji do_j + r_i sum_j ds_ji q_j - (r_i^2 / D) (sum_j ds_ji s_ji) v_i
    dq_j = sum_tokens sum_i ds_ji r_i v_i
The two sums over features that are matrix products, q_j . v_i (over D) and dq_j (over tokens),
run on the tensor cores: bf16 operands, float32 accumulation. The float32 operand (the queries,
the coefficients ds_ji r_i; also the sources when they are not bf16) enters as three bf16 terms
whose sum is exactly that float32 value (_bf16_parts), so the products are those of float32.
Everything else is an elementwise multiply and sum in float32.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values
from jax.experimental.pallas import triton as plgpu

MAX_QUERIES = 16              # queries per kernel call; more run in groups


def feature_chunk(d: int, target: int = 64) -> int:
  """The largest power of two <= target dividing d (at least 16)."""
  c = 1 << (target.bit_length() - 1)
  while c >= 16:
    if d % c == 0:
      return c
    c //= 2
  raise ValueError(f'the Pallas AttnRes kernels need d_model divisible by 16; got {d}')


def triton_params(tiles, kernel=''):
  """Triton settings of one kernel from its tile keys: warps{kernel} and stages{kernel}."""
  return plgpu.CompilerParams(num_warps=tiles['warps' + kernel], num_stages=tiles['stages' + kernel])


# ----------------------------------------------------------------------------- forward


def _bf16_parts(x, parts):
  """float32 x as `parts` bfloat16 terms, each x's leading 8 significant bits left over by the
  terms before it (masked off, not rounded: a mask is exact, and no compiler folds it away as it
  may fold a float32 -> bfloat16 -> float32 round trip). Three terms hold a float32 exactly, for
  |x| above about 2^-110 (below, remainders are subnormal and may flush to zero; inf gives nan)."""
  out = []
  for _ in range(parts):
    top = jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000), jnp.float32)
    out.append(top.astype(jnp.bfloat16))
    x = x - top
  return out


def _logits_kernel(*refs, n, dc, eps, source_parts):
  """Per source: sum of squares by elementwise products, and the dots with the queries' bf16
  terms (_terms_side_by_side) on the tensor cores (bf16 operands, float32 accumulation); writes
  r and the dots times r, whose BF16_TERMS groups of S columns sum to the logits."""
  src, (q_ref,), (terms_ref, r_ref) = refs[:n], refs[n:n + 1], refs[n + 1:]
  bt, d = src[0].shape
  for i in range(n):
    def body(c, carry):
      cols = pl.ds(c * dc, dc)
      v = src[i][:, cols]                                              # [bt, dc]
      v32 = v.astype(jnp.float32)
      sumsq, dots = carry
      for part in _source_terms(v, source_parts):
        dots += jnp.dot(part, q_ref[cols, :], preferred_element_type=jnp.float32)
      return sumsq + jnp.sum(v32 * v32, axis=1), dots
    carry = (jnp.zeros((bt,), jnp.float32), jnp.zeros((bt, q_ref.shape[1]), jnp.float32))
    sumsq, dots = jax.lax.fori_loop(0, d // dc, body, carry)
    r = jax.lax.rsqrt(sumsq / d + eps)
    r_ref[i, :] = r
    terms_ref[i, :, :] = dots * r[:, None]


BF16_TERMS = 3         # bfloat16 terms that hold a float32 value exactly (_bf16_parts)


def _terms_side_by_side(x, axis):
  """float32 x with S rows along `axis` -> bf16, its BF16_TERMS terms concatenated along `axis`
  (row k * S + j holds term k of row j) and zero-padded to _dot_width(S) rows: one operand of a
  dot whose result _sum_terms turns back into S float32 rows."""
  s = x.shape[axis]
  stacked = jnp.concatenate(_bf16_parts(x.astype(jnp.float32), BF16_TERMS), axis=axis)
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, _dot_width(s) - BF16_TERMS * s)
  return jnp.pad(stacked, pad)


def _sum_terms(x, s, axis):
  """The sum of the BF16_TERMS groups of S rows along `axis` of a dot with such an operand."""
  return sum(jax.lax.slice_in_dim(x, k * s, (k + 1) * s, axis=axis) for k in range(BF16_TERMS))


def _source_parts(sources):
  """bf16 terms per source element in the tensor-core dots: bf16 sources are exact in one."""
  return 1 if sources[0].dtype == jnp.bfloat16 else BF16_TERMS


def _source_terms(x, parts):
  """A source tile as the bf16 operands of its dots: x itself (bf16, parts = 1) or its terms."""
  return [x] if parts == 1 else _bf16_parts(x.astype(jnp.float32), parts)


def _dot_width(s):
  """Columns for BF16_TERMS terms of S queries: a power of two >= 16 (a dot's least)."""
  return max(16, 1 << (BF16_TERMS * s - 1).bit_length())


def _combine_kernel(*refs, n, s):
  src, (alpha_ref,), outs = refs[:n], refs[n:n + 1], refs[n + 1:]
  acc = [None] * s
  for i in range(n):
    v = src[i][...].astype(jnp.float32)                               # [bt, dc]
    for j in range(s):
      term = alpha_ref[i, j, :][:, None] * v
      acc[j] = term if acc[j] is None else acc[j] + term
  for j in range(s):
    outs[j][...] = acc[j].astype(outs[j].dtype)


# ----------------------------------------------------------------------------- backward


def _vdo_kernel(*refs, n, s, dc):
  do, src, (g_ref,) = refs[:s], refs[s:s + n], refs[s + n:]
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


def _grads_kernel(*refs, n, s, bt, accumulate, source_parts):
  """One program: a block of rows (rows_grads) by dc features, in steps of bt rows.
  accumulate: dv_in refs (the gradient of the sources' later uses) follow the sources.
  A step stores its n dv tiles only after all of its loads: the compiler cannot tell the outputs
  from the inputs, so no load moves above an earlier store, and a store per source made each
  source wait for its own loads (H200, n = 8: 2.7 ms per call against 2.1). The sums are chains
  of multiply-adds (grad + alpha do, then + b q): one fused instruction per term.
  dq: this program's partial sum_rows b_ji v_i, after the steps: one tensor-core dot per source
  (and bf16 term of the source) of b's bf16 terms [N, rows] (b_parts) against v [rows, dc]."""
  k = n if accumulate else 0
  do, src, dv_in = refs[:s], refs[s:s + n], refs[s + n:s + n + k]
  alpha_ref, b_ref, c_ref, q_ref, b_parts_ref = refs[s + n + k:s + n + k + 5]
  dv, (dq_ref,) = refs[s + n + k + 5:s + 2 * n + k + 5], refs[s + 2 * n + k + 5:]
  q = [q_ref[j, :][None, :] for j in range(s)]                       # [1, dc] each

  def step(t, carry):
    rows = pl.ds(t * bt, bt)
    dos = [do[j][rows, :].astype(jnp.float32) for j in range(s)]       # [bt, dc] each
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
      for part in _source_terms(src[i][ks, :], source_parts):
        dq += jnp.dot(b_parts_ref[i, :, ks], part, preferred_element_type=jnp.float32)
    return dq

  dq_ref[...] = jax.lax.fori_loop(0, block_rows // k_rows, dots, jnp.zeros(dq_ref.shape, jnp.float32))


# ----------------------------------------------------------------------------- wrapper


def defvjp_with_symbolic_zeros(fn, fwd, bwd, num_diff_args: int):
  """fn.defvjp(fwd, bwd) where bwd sees a SymbolicZero for each output that nothing uses (to
  skip work on it; `dense` makes one an array) and fwd gets plain values, not the wrapped
  primals, for fn's first num_diff_args arguments (the differentiable ones)."""
  fn.defvjp(lambda *args: fwd(*custom_vjp_primal_tree_values(args[:num_diff_args]),
                              *args[num_diff_args:]), bwd, symbolic_zeros=True)


def dense(cotangent, shape, dtype):
  """A custom VJP's cotangent (symbolic zeros passed) as an array: zeros if symbolic."""
  return jnp.zeros(shape, dtype) if isinstance(cotangent, SymbolicZero) else cotangent


def pad_rows(x, m_pad):
  """Pads with ones: a zero row would give r = rsqrt(eps), infinite for eps = 0. The padded rows'
  outputs are dropped, so their cotangents, and their share of every gradient, are zero."""
  pad = ((0, m_pad - x.shape[0]),) + ((0, 0),) * (x.ndim - 1)
  return x if x.shape[0] == m_pad else jnp.pad(x, pad, constant_values=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _phase1(sources, queries, eps, tiles, interpret):
  return _phase1_fwd(sources, queries, eps, tiles, interpret)[0]


def _phase1_fwd(sources, queries, eps, tiles, interpret):
  n, (m, d), s = len(sources), sources[0].shape, queries.shape[0]
  bt, dc = tiles['bt'], feature_chunk(d, tiles['dc'])
  q_parts = _terms_side_by_side(queries.T, axis=1)                   # [D, N]
  rows = tiles['bt_logits']
  terms, r = pl.pallas_call(
      functools.partial(_logits_kernel, n=n, dc=feature_chunk(d, tiles['dc_logits']), eps=eps,
                        source_parts=_source_parts(sources)),
      grid=(m // rows,),
      in_specs=[pl.BlockSpec((rows, d), lambda t: (t, 0))] * n
               + [pl.BlockSpec(q_parts.shape, lambda t: (0, 0))],
      out_specs=[pl.BlockSpec((n, rows, q_parts.shape[1]), lambda t: (0, t, 0)),
                 pl.BlockSpec((n, rows), lambda t: (0, t))],
      out_shape=[jax.ShapeDtypeStruct((n, m, q_parts.shape[1]), jnp.float32),
                 jax.ShapeDtypeStruct((n, m), jnp.float32)],
      compiler_params=triton_params(tiles, '_logits'), interpret=interpret,
      name='attnres_phase1_logits',
  )(*sources, q_parts)
  logits = _sum_terms(terms, s, axis=2).transpose(0, 2, 1)          # [n, S, M]
  lse = jax.nn.logsumexp(logits, axis=0)                             # [S, M]
  alpha = jnp.exp(logits - lse)                                      # [n, S, M]
  tile_spec = pl.BlockSpec((bt, dc), lambda t, c: (t, c))
  outs = pl.pallas_call(
      functools.partial(_combine_kernel, n=n, s=s),
      grid=(m // bt, d // dc),
      in_specs=[tile_spec] * n + [pl.BlockSpec((n, s, bt), lambda t, c: (0, 0, t))],
      out_specs=[tile_spec] * s,
      out_shape=[jax.ShapeDtypeStruct((m, d), sources[0].dtype)] * s,
      compiler_params=triton_params(tiles), interpret=interpret, name='attnres_phase1_combine',
  )(*sources, alpha)
  return (tuple(outs), lse, sources), (sources, queries, logits, r, lse)


def _phase1_bwd(eps, tiles, interpret, res, cotangents):
  del eps
  sources, queries, logits, r, lse = res
  d_outs, d_lse, d_sources_in = cotangents
  n, (m, d), s = len(sources), sources[0].shape, lse.shape[0]
  d_outs = [dense(x, (m, d), sources[0].dtype).astype(sources[0].dtype) for x in d_outs]
  d_lse = dense(d_lse, lse.shape, jnp.float32)
  # Sources whose pass-through is unused (the last block's) need no gradient added: a kernel
  # without those inputs, rather than reading n arrays of zeros.
  accumulate = not all(isinstance(x, SymbolicZero) for x in d_sources_in)
  d_sources_in = [dense(x, v.shape, v.dtype) for x, v in zip(d_sources_in, sources)] if accumulate else []
  rows_bt = tiles['bt_vdo']
  vdo = pl.pallas_call(
      functools.partial(_vdo_kernel, n=n, s=s, dc=feature_chunk(d, tiles['dc_vdo'])),
      grid=(m // rows_bt,),
      in_specs=[pl.BlockSpec((rows_bt, d), lambda t: (t, 0))] * (s + n),
      out_specs=pl.BlockSpec((n, s, rows_bt), lambda t: (0, 0, t)),
      out_shape=jax.ShapeDtypeStruct((n, s, m), jnp.float32),
      compiler_params=triton_params(tiles, '_vdo'), interpret=interpret, name='attnres_phase1_vdo',
  )(*d_outs, *sources)
  alpha = jnp.exp(logits - lse)                                      # [n, S, M]
  d_logits = alpha * (vdo - jnp.sum(alpha * vdo, axis=0) + d_lse)
  b = d_logits * r[:, None]
  c = -(r * r / d) * jnp.sum(d_logits * logits, axis=1)               # [n, M]
  b_parts = _terms_side_by_side(b, axis=1)                           # [n, N, M], for the dq dots
  kernel = functools.partial(_grads_kernel, n=n, s=s, bt=tiles['bt_grads'], accumulate=accumulate,
                             source_parts=_source_parts(sources))
  d_sources, dq_parts = grads_call(kernel, d_outs, sources, d_sources_in, (alpha, b, c, queries, b_parts),
                                   tiles, interpret)
  return tuple(d_sources), _sum_terms(jnp.sum(dq_parts, axis=0), s, axis=0)


def grads_call(kernel, d_outs, sources, d_sources_in, coefficients, tiles, interpret=False):
  """The grads kernel's pallas_call (also run by experiments/ablate_attnres_grads.py with copies
  of the kernel): d_outs S and sources n arrays [M, D], d_sources_in n or none, coefficients
  (alpha [n, S, M], b [n, S, M], c [n, M], queries [S, D], b_parts [n, width, M]).
  Returns (n source gradients, per-program dq partials [programs, width, D])."""
  n, (m, d), s = len(sources), sources[0].shape, len(d_outs)
  rows, dc = tiles['rows_grads'], feature_chunk(d, tiles['dc_grads'])
  width = coefficients[-1].shape[1]
  tile_spec = pl.BlockSpec((rows, dc), lambda k, t: (t, k))
  *d_sources, dq_parts = pl.pallas_call(
      kernel,
      grid=(d // dc, m // rows),
      in_specs=[tile_spec] * (s + n + len(d_sources_in))
               + [pl.BlockSpec((n, s, rows), lambda k, t: (0, 0, t))] * 2
               + [pl.BlockSpec((n, rows), lambda k, t: (0, t)), pl.BlockSpec((s, dc), lambda k, t: (0, k)),
                  pl.BlockSpec((n, width, rows), lambda k, t: (0, 0, t))],
      out_specs=[tile_spec] * n + [pl.BlockSpec((None, width, dc), lambda k, t: (t, 0, k))],
      out_shape=[jax.ShapeDtypeStruct((m, d), x.dtype) for x in sources]
                + [jax.ShapeDtypeStruct((m // rows, width, d), jnp.float32)],
      compiler_params=triton_params(tiles, '_grads'), interpret=interpret, name='attnres_phase1_grads',
  )(*d_outs, *sources, *d_sources_in, *coefficients)
  return d_sources, dq_parts


defvjp_with_symbolic_zeros(_phase1, _phase1_fwd, _phase1_bwd, num_diff_args=2)

# Per kernel: rows per tile (bt), features per chunk (dc, a power of two), warps and Triton
# pipeline stages. A grads program covers rows_grads rows in steps of bt_grads; the logits and
# vdo kernels hold whole rows, dc features at a time. Measured on an H200 at S = 6 and n = 8, the
# grads kernel also at n = 3, 4, 5 (experiments/results/bench_attnres.md). rows_grads and
# bt_logits are a dot's dimension: >= 16.
DEFAULT_TILES = {'bt': 16, 'dc': 128, 'warps': 4, 'stages': 2,                 # combine
                 'bt_grads': 8, 'rows_grads': 128, 'dc_grads': 128, 'warps_grads': 4, 'stages_grads': 2,
                 'bt_vdo': 16, 'dc_vdo': 64, 'warps_vdo': 4, 'stages_vdo': 2,
                 'bt_logits': 64, 'dc_logits': 128, 'warps_logits': 4, 'stages_logits': 2}


def phase1(sources, queries, *, eps: float = 1e-6, tiles=None, interpret: bool = False):
  """sources: n >= 1 arrays [..., D] of one shape and dtype; queries [S, D].
  Returns (o: S arrays [..., D] in the sources' dtype, lse [S, ...] float32, the sources again).
  Take later uses of the sources from the third output: their gradient then reaches the
  backward `grads` kernel, which adds it to its own in the same pass (else XLA adds the two
  separately). Differentiable in sources and queries."""
  sources = tuple(sources)
  shape, s = sources[0].shape, queries.shape[0]
  if s < 1 or queries.shape[1:] != shape[-1:]:
    raise ValueError(f'attnres phase1: queries must be [S, {shape[-1]}]; got {queries.shape}')
  if s > MAX_QUERIES:
    outs, lses = (), []
    for k in range(0, s, MAX_QUERIES):
      o, lse, sources = phase1(sources, queries[k:k + MAX_QUERIES], eps=eps, tiles=tiles,
                               interpret=interpret)
      outs, lses = outs + o, lses + [lse]
    return outs, jnp.concatenate(lses), sources
  tiles = with_defaults(tiles, DEFAULT_TILES, 'phase1')
  if min(tiles['rows_grads'], tiles['bt_logits']) < 16:
    raise ValueError(f"attnres phase1: tiles rows_grads and bt_logits are a dot's dimension and must "
                     f"be >= 16; got {tiles['rows_grads']} and {tiles['bt_logits']}")
  if tiles['rows_grads'] % tiles['bt_grads']:
    raise ValueError(f"attnres phase1: tile bt_grads ({tiles['bt_grads']}) must divide rows_grads "
                     f"({tiles['rows_grads']})")
  d, m = shape[-1], math.prod(shape[:-1])
  quantum = math.lcm(tiles['bt'], tiles['rows_grads'], tiles['bt_vdo'], tiles['bt_logits'])
  m_pad = -(-m // quantum) * quantum
  flat = tuple(pad_rows(v.reshape(m, d), m_pad) for v in sources)
  # float32 queries into the custom VJP: the cast's transpose gives dq the queries' own dtype.
  outs, lse, flat = _phase1(flat, queries.astype(jnp.float32), eps, FrozenTiles(tiles), interpret)
  unflat = lambda x: x[:m].reshape(shape)
  return (tuple(map(unflat, outs)), lse[:, :m].reshape((s,) + shape[:-1]), tuple(map(unflat, flat)))


def with_defaults(tiles, defaults, op: str) -> dict:
  """defaults updated with tiles (None: none), refusing keys that defaults does not have."""
  unknown = sorted(set(tiles or {}) - set(defaults))
  if unknown:
    raise ValueError(f'attnres {op}: unknown tile keys {unknown}; allowed: {sorted(defaults)}')
  return dict(defaults, **(tiles or {}))


def parse_tiles(text: str) -> dict:
  """'bt=32/warps=8' -> {'bt': 32, 'warps': 8} ('' -> {}), for the benchmarks' tile flags."""
  try:
    return {k: int(v) for k, v in (kv.split('=') for kv in text.split('/') if kv)}
  except ValueError:
    raise ValueError(f"attnres tiles: expected 'key=int/key=int', got {text!r}") from None


class FrozenTiles(dict):
  """A hashable dict of tile sizes (a static argument of the custom VJP)."""
  def __hash__(self):
    return hash(tuple(sorted(self.items())))
