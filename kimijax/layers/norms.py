"""RMSNorm computed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def rms_normalise(x, eps: float):
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


class RMSNorm(nn.Module):
  """RMSNorm with a learned gain (init 1); output in `dtype`.

  With `fused`, a function (scale, eps, dtype) -> anything, the call returns fused(scale, eps,
  dtype) instead: a kernel that normalises fused with whatever forms its input (AttnRes's phase
  2, kimijax/layers/residual.py); x is then only read for its shape. The parameter is the same
  either way."""
  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x, fused=None):
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                       (x.shape[-1],), jnp.float32)
    if fused is not None:
      return fused(scale, self.eps, self.dtype)
    return (rms_normalise(x, self.eps) * scale).astype(self.dtype)
