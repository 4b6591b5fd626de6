"""KDA's short convolution with its activation (docs/kda.md): the op and its implementations.

    y, next_prefix = short_conv(x, w, activation, prefix=None, impl='xla', settings=None)

x [B, T, H, K], taps w [W, H, K] (float32 parameters); y[t] = act(sum_j w[j] x[t - W + 1 + j]),
channel by channel, with `prefix` [B, W-1, H, K] (the inputs just before x: the decode state)
or zeros before the first token. activation: 'none' | 'silu' | 'silu_l2' (SiLU, then each head's
K features divided by their L2 norm, eps L2_EPS). Returns y and the last W-1 inputs (the next
prefix). IMPLS holds the implementations by name:

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


def causal_depthwise_conv(x, w, prefix=None):
  """sum_j w[j] x[t - W + 1 + j] in x's dtype; returns (y, the last W-1 inputs)."""
  width, t = w.shape[0], x.shape[1]
  if prefix is None:
    prefix = jnp.zeros((x.shape[0], width - 1) + x.shape[2:], x.dtype)
  padded = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)  # [B, T+W-1, ...]
  y = sum(padded[:, j : j + t] * w[j].astype(x.dtype) for j in range(width))
  return y, padded[:, t:]


def _xla(x, w, activation, prefix, settings):
  del settings  # no kernels
  y, next_prefix = causal_depthwise_conv(x, w, prefix)
  return activate(y, activation), next_prefix


def _last_inputs(x, width):
  """The last W-1 rows of x (zeros in front when T < W-1): the next prefix."""
  pad = max(width - 1 - x.shape[1], 0)
  x = jnp.pad(x, ((0, 0), (pad, 0)) + ((0, 0),) * (x.ndim - 2)) if pad else x
  return x[:, x.shape[1] - (width - 1) :]


def _pallas(x, w, activation, prefix, settings):
  if prefix is not None:
    return _xla(x, w, activation, prefix, settings)
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.short_conv import short_conv_pallas

  y = short_conv_pallas(x, w, activation, settings=settings, interpret=kernels_interpreted())
  return y, _last_inputs(x, w.shape[0])


def _pallas_settings(text: str):
  from kernels_pallas.short_conv.settings import ShortConvSettings

  return ShortConvSettings.from_string(text)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of the short conv. short_conv: (x, w, activation, prefix, settings) -> (y,
  next prefix). parse_settings: 'key=int/key=int' -> the settings its kernels take (None: it has
  no kernels and ignores the settings argument)."""

  short_conv: Callable
  parse_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_xla),
    'pallas': Implementation(_pallas, parse_settings=_pallas_settings),
  }
)


def short_conv(x, w, activation: str = 'none', prefix=None, *, impl: str = 'xla', settings=None):
  """The short conv through one dispatch point: impl, a key of IMPLS ('xla' | 'pallas'); settings:
  the kernels' settings of an implementation that has them (None: their defaults)."""
  if impl not in IMPLS:
    raise ValueError(f'short_conv impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  if activation not in ACTIVATIONS:
    raise ValueError(f'short_conv: activation={activation!r} is unknown; allowed: {ACTIVATIONS}')
  if x.ndim != 4 or w.ndim != 3 or w.shape[1:] != x.shape[2:]:
    raise ValueError(f'short_conv: x must be [B, T, H, K] and w [W, H, K]; got x {list(x.shape)}, w {list(w.shape)}')
  return IMPLS[impl].short_conv(x, w, activation, prefix, settings)
