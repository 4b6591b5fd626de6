"""One device mesh with axes (data, fsdp, tensor), and logical-name -> mesh shardings.

Parameters and activations carry logical axis names (see kimijax.config.DEFAULT_RULES); the
rules in `config.mesh.rules` map them onto the mesh, so the same model code runs on one CPU,
8 fake CPU devices, or many GPUs across hosts.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import ml_collections
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kimijax.config import MESH_AXES, ConfigError


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int, platform: str | None = None) -> tuple[int, ...]:
  """Sizes of (data, fsdp, tensor); a -1 takes the devices the other axes leave. `platform`
  'cpu': a mesh that needs more devices says how to get them."""
  sizes = [mesh_cfg[a] for a in MESH_AXES]
  given = ', '.join(f'mesh.{a}={s}' for a, s in zip(MESH_AXES, sizes))
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
      f'mesh.data * mesh.fsdp * mesh.tensor = {math.prod(sizes)} but there are '
      f'{num_devices} devices; set one axis to -1 to use all devices{more}'
    )
  return tuple(sizes)


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices=None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  shape = mesh_shape(mesh_cfg, len(devices), devices[0].platform)
  return jax.make_mesh(shape, MESH_AXES, devices=devices, axis_types=(jax.sharding.AxisType.Auto,) * len(MESH_AXES))


def rules(mesh_cfg: ml_collections.ConfigDict):
  return tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in mesh_cfg.rules)


def logical_shardings(logical_specs, mesh: Mesh, mesh_cfg: ml_collections.ConfigDict):
  """Pytree of logical PartitionSpecs -> pytree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, rules(mesh_cfg))


def batch_sharding(mesh: Mesh, mesh_cfg: ml_collections.ConfigDict) -> NamedSharding:
  """Sharding of [B, T] token batches: batch over the axes 'act_batch' maps to."""
  spec = nn.logical_to_mesh_axes(('act_batch', 'act_length'), rules(mesh_cfg))
  return NamedSharding(mesh, spec)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
