"""Depthwise causal short convolution (KDA's ShortConv, SPEC §1), with a decode state."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp


def causal_depthwise_conv(x, w, prefix=None):
  """y[t] = sum_j w[j] * x[t - (K-1) + j], channel by channel.

  x [B, T, *C], w [K, *C]; prefix [B, K-1, *C]: the inputs just before x (decode state), zeros
  when None. Returns (y [B, T, *C] in x's dtype, the last K-1 inputs: the next prefix).
  """
  width, t = w.shape[0], x.shape[1]
  if prefix is None:
    prefix = jnp.zeros((x.shape[0], width - 1) + x.shape[2:], x.dtype)
  padded = jnp.concatenate([prefix.astype(x.dtype), x], axis=1)          # [B, T+K-1, *C]
  y = sum(padded[:, j: j + t] * w[j].astype(x.dtype) for j in range(width))
  return y, padded[:, t:]


class ShortConv(nn.Module):
  """Depthwise causal conv of [B, T, H, D] over T, no bias; kernel [width, H, D], then
  `activation` (None: identity), inside the module so that a rematerialised caller recomputes both.
  Returns (y, new prefix [B, width-1, H, D])."""
  width: int = 4
  dtype: jnp.dtype = jnp.float32
  activation: Callable | None = None

  @nn.compact
  def __call__(self, x_bthd, prefix=None):
    bound = self.width ** -0.5     # uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = width

    def init(key, shape, dtype):
      return nn.initializers.uniform(2 * bound)(key, shape, dtype) - bound

    w = self.param('kernel', nn.with_logical_partitioning(init, ('conv_width', 'heads', 'head_dim')),
                   (self.width,) + x_bthd.shape[2:], jnp.float32)
    y, new_prefix = causal_depthwise_conv(x_bthd.astype(self.dtype), w, prefix)
    return (y if self.activation is None else self.activation(y)), new_prefix
