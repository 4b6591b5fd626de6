"""KDA's short convolution and its activation (docs/kda.md) as Pallas (Triton) kernels, with a VJP.

    y = short_conv_pallas(x, w, activation, settings=ShortConvSettings(...), interpret=...)

x [B, T, H, K], w [W, H, K] float32 (W taps), activation 'none' | 'silu' | 'silu_l2' (SiLU, then
each head's K features divided by their L2 norm, eps L2_EPS; both defined with the op,
kimijax.ops.short_conv):

    z[t] = sum_j w[j] x[t - W + 1 + j]   (x = 0 before the first token),   y = act(z)

Three kernels, one program per `rows` tokens and `heads` heads (settings.py; every K feature of
a head, for the L2 norm), each reading its W shifted row windows from the whole-sequence block
of its input with masked loads (rows outside [0, T) read as zero):

- `short_conv_fwd`: z and the activation in one pass, y in x's dtype;
- `short_conv_dz`: the backward's first pass: recomputes z, takes the activation's transpose
  (dz = dact(z)^T dy) and writes dz in x's dtype, and each program's part of dw (sum over its
  rows of x[t - W + 1 + j] dz[t], float32, from the float32 dz), summed over programs in XLA.
  Each program runs over `dz_tiles` tiles of `dz_rows` rows in turn (16 rows keep
  the accumulators in registers: 122 per thread at 8 warps), adding the products into W
  elementwise accumulators, and sums them over rows once at the end: that sum is the only part
  of the kernel that crosses warps (shared memory and barriers), and it then runs once per
  dz_tiles row tiles instead of once per row tile;
- `short_conv_dx`: dx[t] = sum_j w[j] dz[t + W - 1 - j], the same conv with its taps mirrored.

With `reach` [B, T] int32 (document masking: how many earlier inputs of its own document each
token's conv may read, kimijax.ops.short_conv) the kernels also read that array and zero a tap
that reaches further back than its output token's reach (in short_conv_fwd and short_conv_dz the
output token is the program's own row; in short_conv_dx, the transposed conv, the row the
mirrored tap reads); without it they are the unmasked programs.

All arithmetic is float32 (y, and dz between the two backward passes, are stored in x's dtype);
the backward keeps only x (padded to whole tiles) and w, and y is never read back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import compiler_params, power_of_two_divisor, round_up
from kernels_pallas.short_conv.settings import ShortConvSettings
from kimijax.ops.short_conv import L2_EPS

F32 = jnp.float32


def _window(ref, start, shape, t):
  """Rows start + [0, rows) of a whole-sequence block [T, heads, K] as float32, [rows, heads, K];
  rows outside [0, t) read as zero (loaded through clamped indices under a mask)."""
  rows, hb, dk = shape
  r = start + jax.lax.broadcasted_iota(jnp.int32, (rows, 1, 1), 0)
  idx = (
    jnp.clip(r, 0, t - 1),
    jax.lax.broadcasted_iota(jnp.int32, (1, hb, 1), 1),
    jax.lax.broadcasted_iota(jnp.int32, (1, 1, dk), 2),
  )
  inside = jnp.broadcast_to((r >= 0) & (r < t), shape)
  return plgpu.load(ref.at[idx], mask=inside, other=0).astype(F32)


def _rows(ref, start, rows, t):
  """Rows start + [0, rows) of a whole-sequence int32 block [T], [rows]; rows outside [0, t) read
  as zero."""
  r = start + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
  return plgpu.load(ref.at[jnp.clip(r, 0, t - 1)], mask=(r >= 0) & (r < t), other=0)


def _within_reach(x, reach_ref, start, back, sign, t):
  """x [rows, heads, K], a tap's inputs for the rows start + [0, rows) reaching `back` tokens from
  their output token (the row itself when sign = 1; row + back in the transposed conv, sign = -1),
  zeroed where that token's reach (reach_ref) is smaller; x itself without reach_ref or for back 0."""
  if reach_ref is None or back == 0:
    return x
  reach = _rows(reach_ref, start + (back if sign < 0 else 0), x.shape[0], t)
  return jnp.where((reach >= back)[:, None, None], x, 0.0)


def sigmoid(z):
  return 1.0 / (1.0 + jnp.exp(-z))


def activate(z, activation):
  """The activation `activation` (kimijax.ops.short_conv.ACTIVATIONS) of float32 z, the L2 norm over
  its last axis: the convs' kernels' and the KDA decode kernel's (kernels_pallas/kda/decode.py)."""
  if activation == 'none':
    return z
  a = z * sigmoid(z)
  if activation == 'silu':
    return a
  return a * jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + L2_EPS)


def _activate_transpose(z, dy, activation):
  """dz from dy through act at z: SiLU' = s (1 + z (1 - s)); the L2 norm's transpose is
  n (dy - y sum(dy y)) with n = 1 / sqrt(sum a^2 + eps), y = a n."""
  if activation == 'none':
    return dy
  s = sigmoid(z)
  a = z * s
  if activation == 'silu_l2':
    n = jax.lax.rsqrt(jnp.sum(a * a, axis=-1, keepdims=True) + L2_EPS)
    y = a * n
    dy = n * (dy - y * jnp.sum(dy * y, axis=-1, keepdims=True))
  return dy * s * (1.0 + z * (1.0 - s))


def _conv(x_ref, w_ref, reach_ref, shape, t, sign):
  """sum_j w[j] x[t0 + rows + sign (j - W + 1)] for this program's rows t0 + [0, rows) (taps past
  the reach zeroed: _within_reach)."""
  width = w_ref.shape[0]
  t0 = pl.program_id(1) * shape[0]
  # w[j] loaded before its window: without reach_ref, the same program as the plain conv
  return sum(
    w_ref[j][None]
    * _within_reach(_window(x_ref, t0 + sign * (j - width + 1), shape, t), reach_ref, t0, width - 1 - j, sign, t)
    for j in range(width)
  )


def _fwd_kernel(x_ref, w_ref, *refs, t, sign, activation):
  """refs: (y_ref,), or (reach_ref, y_ref) with document masking."""
  *reach_ref, y_ref = refs
  reach_ref = reach_ref[0] if reach_ref else None
  y_ref[...] = activate(_conv(x_ref, w_ref, reach_ref, y_ref.shape, t, sign), activation).astype(y_ref.dtype)


def _dz_kernel(x_ref, w_ref, dy_ref, *refs, t, rows, activation):
  """dy_ref, dz_ref: this program's tiles of n * rows rows, taken `rows` at a time. refs: (dz_ref,
  dw_ref), after reach_ref with document masking."""
  *reach_ref, dz_ref, dw_ref = refs
  reach_ref = reach_ref[0] if reach_ref else None
  width = w_ref.shape[0]
  shape = (rows,) + dz_ref.shape[1:]
  n = dz_ref.shape[0] // rows
  t0 = pl.program_id(1) * (n * rows)  # read outside the loop: interpret mode needs it there

  def tile(i, acc):
    start = t0 + i * rows
    xs = [_window(x_ref, start + j - width + 1, shape, t) for j in range(width)]
    xs = [_within_reach(x, reach_ref, start, width - 1 - j, 1, t) for j, x in enumerate(xs)]
    z = sum(w_ref[j][None] * xs[j] for j in range(width))
    at = pl.ds(i * rows, rows)
    dz = _activate_transpose(z, dy_ref[at].astype(F32), activation)
    dz_ref[at] = dz.astype(dz_ref.dtype)
    return tuple(a + x * dz for a, x in zip(acc, xs))

  acc = jax.lax.fori_loop(0, n, tile, tuple(jnp.zeros(shape, F32) for _ in range(width)))
  for j in range(width):
    dw_ref[j] = jnp.sum(acc[j], axis=0)


def _specs(tp, hb, dk, width, rows):
  whole = pl.BlockSpec((None, tp, hb, dk), lambda bi, ti, hi: (bi, 0, hi, 0))
  tile = pl.BlockSpec((None, rows, hb, dk), lambda bi, ti, hi: (bi, ti, hi, 0))
  taps = pl.BlockSpec((width, hb, dk), lambda bi, ti, hi: (0, hi, 0))
  return whole, tile, taps


def _reach_input(reach, tp):
  """(in_specs, args) the kernels add for reach [B, T] int32 (None: none): the whole row."""
  if reach is None:
    return [], []
  return [pl.BlockSpec((None, tp), lambda bi, ti, hi: (bi, 0))], [reach]


def _tiles(x, settings):
  b, tp, h, dk = x.shape
  return b, tp, h, dk, settings.rows, power_of_two_divisor(h, settings.heads)


def _conv_call(x, w, reach, *, sign, activation, settings, interpret, name):
  b, tp, h, dk, rows, hb = _tiles(x, settings)
  whole, tile, taps = _specs(tp, hb, dk, w.shape[0], rows)
  reach_specs, reach_args = _reach_input(reach, tp)
  return pl.pallas_call(
    functools.partial(_fwd_kernel, t=tp, sign=sign, activation=activation),
    grid=(b, tp // rows, h // hb),
    in_specs=[whole, taps] + reach_specs,
    out_specs=tile,
    out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name=name,
  )(x, w, *reach_args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _short_conv(x, w, reach, activation, settings, interpret):
  return _conv_call(
    x, w, reach, sign=1, activation=activation, settings=settings, interpret=interpret, name='short_conv_fwd'
  )


def _short_conv_fwd(x, w, reach, activation, settings, interpret):
  return _short_conv(x, w, reach, activation, settings, interpret), (x, w, reach)


def _short_conv_bwd(activation, settings, interpret, res, dy):
  x, w, reach = res
  b, tp, h, dk, _, hb = _tiles(x, settings)
  width = w.shape[0]
  rows, n = settings.dz_layout(tp)  # rows per tile of short_conv_dz, row tiles per program
  whole, tiles, taps = _specs(tp, hb, dk, width, n * rows)
  part = pl.BlockSpec((None, None, width, hb, dk), lambda bi, ti, hi: (bi, ti, 0, hi, 0))
  reach_specs, reach_args = _reach_input(reach, tp)
  dz, dw_parts = pl.pallas_call(
    functools.partial(_dz_kernel, t=tp, rows=rows, activation=activation),
    grid=(b, tp // (n * rows), h // hb),
    in_specs=[whole, taps, tiles] + reach_specs,
    out_specs=[tiles, part],
    out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((b, tp // (n * rows), width, h, dk), F32)],
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='short_conv_dz',
  )(x, w, dy.astype(x.dtype), *reach_args)
  dx = _conv_call(
    dz, w, reach, sign=-1, activation='none', settings=settings, interpret=interpret, name='short_conv_dx'
  )
  return dx, jnp.sum(dw_parts, axis=(0, 1)).astype(w.dtype), None


_short_conv.defvjp(_short_conv_fwd, _short_conv_bwd)


def short_conv_pallas(x, w, activation='none', *, settings=None, interpret=False, reach=None):
  """act(causal depthwise conv of x [B, T, H, K] with taps w [W, H, K]) in x's dtype (see the
  module docstring; kimijax.ops.short_conv checks the arguments); any T, K a power of two >= 16.
  settings: the kernels' ShortConvSettings (None: the defaults). reach: None, or [B, T] int, the
  earlier inputs each token's conv may read (a tap reaching further back reads zero). Differentiable
  in x and w."""
  dk = x.shape[-1]
  if dk < 16 or dk & (dk - 1):
    raise ValueError(
      f"short_conv impl='pallas': K = {dk} must be a power of two >= 16 (x {list(x.shape)}); "
      "use impl='xla' for other sizes"
    )
  settings = ShortConvSettings() if settings is None else settings
  if not isinstance(settings, ShortConvSettings):
    raise TypeError(
      f"short_conv impl='pallas': settings must be a ShortConvSettings "
      f'(kernels_pallas/short_conv/settings.py) or None, got {type(settings).__name__}'
    )
  reach = None if reach is None else jnp.asarray(reach, jnp.int32)
  return _short_conv_padded(x, w, reach, activation=activation, settings=settings, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=('activation', 'settings', 'interpret'))
def _short_conv_padded(x, w, reach=None, *, activation, settings, interpret):
  """short_conv_pallas under one jax.jit, shared by every layer's call (kernels_pallas/__init__.py)."""
  t = x.shape[1]
  pad = round_up(t, settings.rows) - t
  xp = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) if pad else x
  if reach is not None and pad:
    reach = jnp.pad(reach, ((0, 0), (0, pad)))
  y = _short_conv(xp, w.astype(F32), reach, activation, settings, interpret)
  return y[:, :t] if pad else y
