"""Train state (step, params, optimizer state, MoE balancing biases) created directly in its sharded layout."""

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
from kimijax.layers.moe import MOE_STATE
from kimijax.parallel import mesh as mesh_lib


@flax.struct.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # float32 parameter pytree
  opt_state: Any
  # The model's 'moe_state' collection: each MoE layer's balancing bias [E] float32, moved by the
  # train step after each step (docs/moe.md), outside the optimizer and its weight decay,
  # replicated, checkpointed with the rest. {} for a model without MoE layers.
  moe_state: Any = flax.struct.field(default_factory=dict)


def _init_fn(model: nn.Module, optimizer: optax.GradientTransformation, seq_len: int):
  def init(rng):
    tokens_bt = jnp.zeros((1, seq_len), jnp.int32)
    variables = model.init(rng, tokens_bt)
    params = variables['params']  # boxed with logical axis names
    return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      moe_state=dict(variables.get(MOE_STATE, {})),
    )

  return init


def state_shardings(model, optimizer, config: ml_collections.ConfigDict, mesh: Mesh):
  """(abstract unboxed TrainState with .sharding set, pytree of NamedShardings)."""
  init = _init_fn(model, optimizer, config.train.seq_len)
  boxed = jax.eval_shape(init, jax.random.key(0))
  logical = nn.get_partition_spec(boxed)
  shardings = mesh_lib.logical_shardings(logical, mesh, config.mesh)
  _check_divisible(nn.unbox(boxed.params), logical.params, shardings.params)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed), shardings)
  return abstract, shardings


def _check_divisible(params, logical_specs, shardings) -> None:
  """Every sharded parameter dimension must divide evenly over its mesh axes."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  for (path, value), names, sharding in zip(
    flat, jax.tree.leaves(logical_specs, is_leaf=_is_spec), jax.tree.leaves(shardings)
  ):
    for dim, name, axes in zip(value.shape, names, sharding.spec):
      axes = (axes,) if isinstance(axes, str) else (axes or ())
      ways = math.prod(sharding.mesh.shape[a] for a in axes)
      if dim % ways:
        raise ConfigError(
          f'parameter {jax.tree_util.keystr(path)} has dimension {name!r} of size {dim}, which does '
          f'not divide over mesh axes {axes} ({ways} ways); change the model size or mesh.* / mesh.rules'
        )


def _is_spec(x) -> bool:
  return isinstance(x, jax.sharding.PartitionSpec)


def _has_cpu_backend() -> bool:
  try:
    return bool(jax.devices('cpu'))
  except RuntimeError:  # JAX_PLATFORMS names only the accelerator
    return False


# The largest train state that init_state builds on the host CPU (see init_state).
HOST_INIT_MAX_BYTES = 16 * 2**30


def init_state(
  model, optimizer, config: ml_collections.ConfigDict, abstract: TrainState, *, on_host: bool | None = None
) -> TrainState:
  """Fresh state from config.seed in the layout of `abstract` (state_shardings' first result); where
  config.train.init_from names a run folder or a released checkpoint, its parameters and MoE
  biases instead of random ones (the optimizer state is fresh either way).

  on_host True: the initialisers run on the host CPU and the state is then copied to its shards;
  False: each array is created on its own shards. None (default): on the host when this is the
  only process, the arrays live on an accelerator and the state is at most HOST_INIT_MAX_BYTES.
  Why: the initialisers are a few thousand small random-number fusions (linear in depth), which
  XLA compiled in 25 s for a 2-core CPU and in 85-160 s for an H200 at configs/bench_350m.py's
  size, while the copy is a few GiB over the host link (not yet timed on a GPU). The random bits
  are the same either way; the float transforms of them may differ in the last bit between
  backends."""
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  if config.train.init_from:
    return _initial_state(optimizer, config, abstract, shardings)
  init = _init_fn(model, optimizer, config.train.seq_len)
  if on_host is None:
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(abstract))
    on_host = (
      jax.process_count() == 1
      and jax.default_backend() != 'cpu'
      and _has_cpu_backend()
      and nbytes <= HOST_INIT_MAX_BYTES
    )
  key = jax.random.key(config.seed)
  build = lambda rng: nn.unbox(init(rng))
  if not on_host:
    return jax.jit(build, out_shardings=shardings)(key)
  host = jax.jit(build)(jax.device_put(key, jax.devices('cpu')[0]))
  return jax.device_put(host, shardings)


def _initial_state(optimizer, config: ml_collections.ConfigDict, abstract: TrainState, shardings) -> TrainState:
  """Step 0 with the parameters and MoE biases that config.train.init_from names (a run's latest
  checkpoint or a released folder: checkpoint.initial_weights), read into their shards, and the
  optimizer's initial state for them. Nothing is drawn at random, and the read arrays are donated
  into the state, so the parameters are held once."""
  from kimijax.train.checkpoint import initial_weights

  params, moe_state = initial_weights(config, abstract.params, abstract.moe_state)
  fresh = lambda p, m: TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p), moe_state=m)
  return jax.jit(fresh, out_shardings=shardings, donate_argnums=(0, 1))(params, moe_state)
