"""KDA's short convolution with its activation (docs/kda.md): the op and its implementations.

    y, next_prefix = short_conv(x, w, activation, prefix=None, impl='xla', settings=None)

x [B, T, H, K], taps w [W, H, K] (float32 parameters); y[t] = act(sum_j w[j] x[t - W + 1 + j]),
channel by channel, with `prefix` [B, W-1, H, K] (the inputs just before x: the decode state)
or zeros before the first token. activation: 'none' | 'silu' | 'silu_l2' (SiLU, then each head's
K features divided by their L2 norm, eps L2_EPS). Returns y and the last W-1 inputs (the next
prefix). With `segment_ids` [B, T] (packed documents, kimijax/ops/segments.py) the conv at each
token reads zeros for the inputs of other documents: a tap reaching back past the first token of
the token's document contributes nothing (the row's first document reads the prefix). IMPLS holds
the implementations by name:

- 'xla': the conv and the activation in x's dtype (the L2 norm in float32), XLA autodiff;
- 'pallas': kernels_pallas/short_conv (one fused pass forward, two backward, float32
  arithmetic, the backward recomputes the conv; interpreted off the GPU; its Triton settings
  as `settings=`, a ShortConvSettings, None the defaults) in training; with a prefix (prefill
  and decoding from a cache, never differentiated) it runs the 'xla' form.

The activations and L2_EPS are defined here; the kernels import them.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kimijax.ops.segments import segment_start_index

L2_EPS = 1e-6  # eps of 'silu_l2''s L2 norm
ACTIVATIONS = ('none', 'silu', 'silu_l2')  # the activations after the conv, by name


def l2_normalise(x, eps: float = L2_EPS):
  """x / sqrt(sum(x^2) + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def activate(x, activation: str):
  """The activation after the conv, by name (also used alone when a layer has no conv)."""
  if activation == 'none':
    return x
  a = jax.nn.silu(x)
  return l2_normalise(a) if activation == 'silu_l2' else a


def conv_reach(segment_ids_bt, width: int):
  """int32 [B, T]: how many inputs before each token its conv may read under segment_ids, the
  tokens of its own segment before it (the row's first segment: W - 1, its prefix included)."""
  index = segment_start_index(segment_ids_bt)
  since = jnp.arange(index.shape[1], dtype=jnp.int32) - index
  return jnp.where(index == 0, width - 1, jnp.minimum(since, width - 1))


def causal_depthwise_conv(x, w, prefix=None, reach=None):
  """sum_j w[j] x[t - W + 1 + j] in x's dtype; returns (y, the last W-1 inputs). reach [B, T]
  (conv_reach): tap j only where it reaches back W - 1 - j <= reach[t] inputs."""
  width, t = w.shape[0], x.shape[1]
  if prefix is None:
    prefix = jnp.zeros((x.shape[0], width - 1) + x.shape[2:], x.dtype)
  padded = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)  # [B, T+W-1, ...]

  def tap(j):
    x_j = padded[:, j : j + t]
    if reach is not None and j < width - 1:
      x_j = jnp.where((reach >= width - 1 - j)[:, :, None, None], x_j, jnp.zeros((), x.dtype))
    return x_j * w[j].astype(x.dtype)

  return sum(tap(j) for j in range(width)), padded[:, t:]


def _xla(x, w, activation, prefix, settings, reach=None):
  del settings  # no kernels
  y, next_prefix = causal_depthwise_conv(x, w, prefix, reach)
  return activate(y, activation), next_prefix


def _last_inputs(x, width):
  """The last W-1 rows of x (zeros in front when T < W-1): the next prefix."""
  pad = max(width - 1 - x.shape[1], 0)
  x = jnp.pad(x, ((0, 0), (pad, 0)) + ((0, 0),) * (x.ndim - 2)) if pad else x
  return x[:, x.shape[1] - (width - 1) :]


def _pallas(x, w, activation, prefix, settings, reach=None):
  if prefix is not None:
    return _xla(x, w, activation, prefix, settings, reach)
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.short_conv import short_conv_pallas

  kw = {} if reach is None else dict(reach=reach)
  y = short_conv_pallas(x, w, activation, settings=settings, interpret=kernels_interpreted(), **kw)
  return y, _last_inputs(x, w.shape[0])


def _pallas_settings(text: str):
  from kernels_pallas.short_conv.settings import ShortConvSettings

  return ShortConvSettings.from_string(text)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of the short conv. short_conv: (x, w, activation, prefix, settings[, reach])
  -> (y, next prefix), reach (conv_reach) given only under segment_ids. parse_settings:
  'key=int/key=int' -> the settings its kernels take (None: it has no kernels and ignores the
  settings argument)."""

  short_conv: Callable
  parse_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_xla),
    'pallas': Implementation(_pallas, parse_settings=_pallas_settings),
  }
)


def short_conv(x, w, activation: str = 'none', prefix=None, *, impl: str = 'xla', settings=None, segment_ids=None):
  """The short conv through one dispatch point: impl, a key of IMPLS ('xla' | 'pallas'); settings:
  the kernels' settings of an implementation that has them (None: their defaults); segment_ids:
  None, or [B, T] int, packed documents kept apart (the module docstring)."""
  if impl not in IMPLS:
    raise ValueError(f'short_conv impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  if activation not in ACTIVATIONS:
    raise ValueError(f'short_conv: activation={activation!r} is unknown; allowed: {ACTIVATIONS}')
  if x.ndim != 4 or w.ndim != 3 or w.shape[1:] != x.shape[2:]:
    raise ValueError(f'short_conv: x must be [B, T, H, K] and w [W, H, K]; got x {list(x.shape)}, w {list(w.shape)}')
  if segment_ids is None:
    return IMPLS[impl].short_conv(x, w, activation, prefix, settings)
  segment_ids = jnp.asarray(segment_ids)
  if segment_ids.shape != x.shape[:2]:
    raise ValueError(f'short_conv: segment_ids must be [B, T] = {list(x.shape[:2])}; got {list(segment_ids.shape)}')
  return IMPLS[impl].short_conv(x, w, activation, prefix, settings, conv_reach(segment_ids, w.shape[0]))
