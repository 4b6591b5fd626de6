"""Depthwise causal short convolution (KDA's ShortConv, docs/kda.md): its taps and a decode state."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from kimijax.ops.short_conv import short_conv


class ShortConv(nn.Module):
  """Depthwise causal conv of [B, T, H, D] over T, no bias; taps [width, H, D] float32, then
  `activation` (a name of kimijax.ops.short_conv.ACTIVATIONS), in one op so that a rematerialised
  caller recomputes both. The input is cast to `dtype`. Returns (y, new prefix [B, width-1, H, D]).
  segment_ids [B, T]: packed documents; a token's conv reads no input of another document."""

  width: int = 4
  dtype: jnp.dtype = jnp.float32
  activation: str = 'none'
  impl: str = 'xla'  # kimijax.ops.short_conv.IMPLS
  settings: Any = None  # the kernels' settings of an impl that has them (None: the defaults)

  @nn.compact
  def taps(self, channels: tuple[int, ...]):
    """The taps [width, *channels] float32 (the parameter 'kernel'), for a caller that runs the conv
    inside another op (a KDA layer's decode step, kimijax.ops.kda.kda_decode)."""
    bound = self.width**-0.5  # uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = width

    def init(key, shape, dtype):
      return nn.initializers.uniform(2 * bound)(key, shape, dtype) - bound

    return self.param(
      'kernel',
      nn.with_logical_partitioning(init, ('conv_width', 'heads', 'head_dim')),
      (self.width,) + tuple(channels),
      jnp.float32,
    )

  def __call__(self, x_bthd, prefix=None, segment_ids=None):
    return short_conv(
      x_bthd.astype(self.dtype),
      self.taps(x_bthd.shape[2:]),
      self.activation,
      prefix,
      impl=self.impl,
      settings=self.settings,
      segment_ids=segment_ids,
    )
