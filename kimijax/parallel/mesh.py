"""One device mesh with axes (data, fsdp, tensor[, expert]), and logical-name -> mesh shardings.

Parameters and activations carry logical axis names (see kimijax.config.DEFAULT_RULES); the
rules in `config.mesh.rules` map them onto the mesh, so the same model code runs on one CPU,
8 fake CPU devices, or many GPUs across hosts. The 'expert' axis (expert parallelism, docs/moe.md)
is in the mesh only when mesh.expert > 1; the rules then drop the axes the mesh lacks, so a model
without it shards exactly as over (data, fsdp, tensor).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kimijax.config import MESH_AXES, ConfigError


def mesh_axes(mesh_cfg: ml_collections.ConfigDict) -> tuple[str, ...]:
  """The axes of the mesh: (data, fsdp, tensor), and 'expert' when mesh.expert > 1."""
  return tuple(a for a in MESH_AXES if a != 'expert' or mesh_cfg.get('expert', 1) != 1)


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int, platform: str | None = None) -> tuple[int, ...]:
  """Sizes of mesh_axes(mesh_cfg); a -1 takes the devices the other axes leave. `platform`
  'cpu': a mesh that needs more devices says how to get them."""
  axes = mesh_axes(mesh_cfg)
  sizes = [mesh_cfg[a] for a in axes]
  given = ', '.join(f'mesh.{a}={s}' for a, s in zip(axes, sizes))
  if sizes.count(-1) > 1:
    raise ConfigError(
      f'at most one mesh axis may be -1 (it takes the devices the others leave); got {given} for {num_devices} devices'
    )
  fixed = math.prod(s for s in sizes if s != -1)
  more = (
    f'; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={fixed} (set before the command) makes '
    f'{fixed} CPU devices'
    if platform == 'cpu' and fixed > num_devices
    else ''
  )
  if -1 in sizes:
    if num_devices % fixed:
      raise ConfigError(f'{given}: the fixed axes (product {fixed}) do not divide the {num_devices} devices{more}')
    sizes[sizes.index(-1)] = num_devices // fixed
  if math.prod(sizes) != num_devices:
    raise ConfigError(
      f'{" * ".join(f"mesh.{a}" for a in axes)} = {math.prod(sizes)} but there are '
      f'{num_devices} devices; set one axis to -1 to use all devices{more}'
    )
  return tuple(sizes)


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  shape, axes = mesh_shape(mesh_cfg, len(devices), devices[0].platform), mesh_axes(mesh_cfg)
  return jax.make_mesh(shape, axes, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


def rules(mesh_cfg: ml_collections.ConfigDict):
  """mesh.rules with the mesh axes the mesh lacks (mesh_axes) dropped: ('act_batch', ('data',
  'fsdp', 'expert')) becomes ('act_batch', ('data', 'fsdp')) without an expert axis."""
  present = set(mesh_axes(mesh_cfg))

  def keep(axes):
    if axes is None or isinstance(axes, str):
      return axes if axes is None or axes in present else None
    kept = tuple(a for a in axes if a in present)
    return kept or None

  return tuple((name, keep(tuple(axes) if isinstance(axes, list) else axes)) for name, axes in mesh_cfg.rules)


def logical_shardings(logical_specs, mesh: Mesh, mesh_cfg: ml_collections.ConfigDict):
  """Pytree of logical PartitionSpecs -> pytree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules(mesh_cfg))


def batch_sharding(mesh: Mesh, mesh_cfg: ml_collections.ConfigDict) -> NamedSharding:
  """Sharding of [B, T] token batches: batch over the axes 'act_batch' maps to."""
  spec = nn.logical_to_mesh_axes(('act_batch', 'act_length'), rules(mesh_cfg))
  return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
