"""RMS normalisation as a pure function (the RMSNorm layer and the ops that fuse a norm use it)."""

from __future__ import annotations

import jax.numpy as jnp


def rms_normalise(x, eps: float):
  """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
  x = x.astype(jnp.float32)
  return x * jnp.reciprocal(jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))
