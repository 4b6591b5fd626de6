"""RMSNorm computed in float32."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from kimijax.ops.norms import rms_normalise

__all__ = ['RMSNorm', 'rms_normalise']


class RMSNorm(nn.Module):
  """RMSNorm with a learned gain `scale` [D] (init 1); output in `dtype`. `gain(d)` returns the
  gain alone, for callers that apply the norm inside a fused op (AttnRes's merge_norm,
  kimijax/layers/residual.py); the parameter is the same either way."""

  eps: float = 1e-6
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def gain(self, dim: int):
    return self.param('scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)), (dim,), jnp.float32)

  def __call__(self, x):
    return (rms_normalise(x, self.eps) * self.gain(x.shape[-1])).astype(self.dtype)
