"""Train state (step, params, optimizer state) created directly in its sharded layout."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from kimijax.config import ConfigError
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
  logical = nn.get_partition_spec(boxed)
  shardings = mesh_lib.logical_shardings(logical, mesh, config.mesh)
  _check_divisible(nn.unbox(boxed.params), logical.params, shardings.params)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nn.unbox(boxed), shardings)
  return abstract, shardings


def _check_divisible(params, logical_specs, shardings) -> None:
  """Every sharded parameter dimension must divide evenly over its mesh axes."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, value), names, sharding in zip(flat, jax.tree.leaves(logical_specs, is_leaf=_is_spec),
                                            jax.tree.leaves(shardings)):
    for dim, name, axes in zip(value.shape, names, sharding.spec):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      ways = math.prod(sharding.mesh.shape[a] for a in axes)
      if dim % ways:
        raise ConfigError(
            f'parameter {jax.tree_util.keystr(path)} has dimension {name!r} of size {dim}, which does '
            f'not divide over mesh axes {axes} ({ways} ways); change the model size or mesh.* / mesh.rules')


def _is_spec(x) -> bool:
  return isinstance(x, jax.sharding.PartitionSpec)


def init_state(model, optimizer, config: ml_collections.ConfigDict, shardings) -> TrainState:
  """Fresh state from config.seed, each array created on its own shards."""
  init = _init_fn(model, optimizer, config.train.seq_len)
  return jax.jit(lambda rng: nn.unbox(init(rng)), out_shardings=shardings)(jax.random.key(config.seed))
