"""The one way layers create weight matrices, and project one input by several of them."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def weight(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str | None, ...]):
  """A float32 parameter `name` of `shape` with logical axis `names`, initialised N(0,
  module.init_std), returned cast to module.dtype (the compute dtype). Call inside a compact method."""
  init = nn.with_logical_partitioning(nn.initializers.normal(module.init_std), names)
  return module.param(name, init, shape, jnp.float32).astype(module.dtype)


def project(x_btd, *weights):
  """x [B, T, D] times each weight [D, ...] (all of one shape): a tuple of [B, T, ...]. Over many
  tokens, one GEMM of the weights stacked on a new output axis (a wide GEMM; the stack, a copy of
  the weights, is small against it). At one token per sequence (a decode step) one matmul each:
  XLA merges such small matmuls and reads every weight in place, where the stack would write a
  copy of the weights on every step."""
  if x_btd.shape[1] == 1:
    return tuple(jnp.einsum('btd,d...->bt...', x_btd, w) for w in weights)
  stacked = jnp.einsum('btd,ds...->bts...', x_btd, jnp.stack(weights, axis=1))
  return tuple(stacked[:, :, i] for i in range(len(weights)))
