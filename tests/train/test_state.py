"""init_state's two placements (kimijax/train/state.py): the initialisers run on the host CPU and
copied to the shards, or run on the shards themselves; the same state, in the same layout; and
on the host, none of the forward's GPU kernels is lowered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_config import TINY, make_config

from kernels_pallas import common
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.state import init_state
from kimijax.train.step import build_training


def test_host_init_gives_the_sharded_init_state_in_its_layout():
  config = make_config({**TINY, 'model.layer_pattern': 'KA', 'mesh.fsdp': 4, 'mesh.data': 2})
  mesh = mesh_lib.make_mesh(config.mesh)
  run = build_training(config, mesh)
  abstract = run.abstract_state
  on_mesh = init_state(run.model, run.optimizer, config, abstract, on_host=False)
  on_host = init_state(run.model, run.optimizer, config, abstract, on_host=True)
  flat = jax.tree_util.tree_flatten_with_path(on_host)[0]
  assert len(flat) == len(jax.tree.leaves(on_mesh)) > 10
  assert any(len(set(a.sharding.spec) - {None}) for _, a in flat)  # some leaves really are sharded
  for (path, a), b, want in zip(flat, jax.tree.leaves(on_mesh), jax.tree.leaves(abstract)):
    name = jax.tree_util.keystr(path)
    assert a.sharding == b.sharding == want.sharding, name
    assert (a.shape, a.dtype) == (want.shape, want.dtype), name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_host_init_never_lowers_the_forwards_gpu_kernels(monkeypatch):
  """model.init runs a forward whose output is dropped; JAX removes it before lowering, so on a
  GPU host the initialisers compile for the CPU although the forward's kernels could not. Here the
  Pallas kernels lower as on a GPU (through Triton), which the CPU cannot: the forward fails to
  compile for it, and the host init must not."""
  config = make_config(
    {**TINY, 'model.layer_pattern': 'KA', 'model.kda_impl': 'pallas', 'model.short_conv_impl': 'pallas'}
  )
  run = build_training(config, mesh_lib.make_mesh(config.mesh))
  monkeypatch.setattr(common, 'kernels_interpreted', lambda: False)
  state = init_state(run.model, run.optimizer, config, run.abstract_state, on_host=True)
  forward = jax.jit(lambda p, t: run.model.apply({'params': p}, t)[0])
  with pytest.raises(Exception, match='interpret'):
    forward.lower(state.params, jnp.zeros((1, TINY['train.seq_len']), jnp.int32)).compile()
