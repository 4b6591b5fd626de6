"""The one way layers create weight matrices."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def weight(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str | None, ...]):
  """A float32 parameter `name` of `shape` with logical axis `names`, initialised N(0,
  module.init_std), returned cast to module.dtype (the compute dtype). Call inside a compact method."""
  init = nn.with_logical_partitioning(nn.initializers.normal(module.init_std), names)
  return module.param(name, init, shape, jnp.float32).astype(module.dtype)
