"""Running a kernel per shard: under a mesh of several devices, an op whose implementation is a
Pallas call (which XLA cannot partition: it would gather the operands onto every device) runs it
through shard_map on each device's share of the arrays instead."""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P


def lead_spec(spec: P | None, ndim: int) -> tuple:
  """The mesh axes of the leading (token) axes of an array [..., D] laid out as `spec`."""
  return (tuple(spec or ()) + (None,) * ndim)[: ndim - 1]


def run_per_shard(run, args, in_specs, out_specs, across_shards=None):
  """run(*args); under a current mesh of several devices (jax.set_mesh, as the train step does),
  run per shard through shard_map with those specs, then across_shards (if given) on each
  shard's outputs: the collective (e.g. a pmax over the batch axes) that makes per-shard partial
  results whole. check_vma=False because pallas_call outputs carry no varying-axes type, so
  out_specs are taken on trust: an output replicated in out_specs must agree across shards."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return run(*args)
  per_shard = run if across_shards is None else lambda *a: across_shards(run(*a))
  return jax.shard_map(per_shard, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def spec_axes(entry) -> tuple[str, ...]:
  """The mesh axis names of one PartitionSpec entry (None, a name or a tuple of names)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)
