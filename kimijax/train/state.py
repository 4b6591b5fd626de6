"""Train state (step, params, optimizer state) created directly in its sharded layout."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from kimijax.parallel import mesh as mesh_lib


@flax.struct.dataclass
class TrainState:
  step: jax.Array          # int32 scalar: optimizer steps taken
  params: Any              # float32 parameter pytree
  opt_state: Any


def _init_fn(model: nn.Module, optimizer: optax.GradientTransformation, seq_len: int):
  def init(rng):
    tokens_bt = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(rng, tokens_bt)['params']   # boxed with logical axis names
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
  return init


def state_shardings(model, optimizer, config: ml_collections.ConfigDict, mesh: Mesh):
  """(abstract unboxed TrainState with .sharding set, pytree of NamedShardings)."""
  init = _init_fn(model, optimizer, config.train.seq_len)
  boxed = jax.eval_shape(init, jax.random.key(0))
  shardings = mesh_lib.logical_shardings(nn.get_partition_spec(boxed), mesh, config.mesh)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.unbox(boxed), shardings)
  return abstract, shardings


def init_state(model, optimizer, config: ml_collections.ConfigDict, shardings) -> TrainState:
  """Fresh state from config.seed, each array created on its own shards."""
  init = _init_fn(model, optimizer, config.train.seq_len)
  return jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)(jax.random.key(config.seed))
