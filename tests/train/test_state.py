"""init_state's two placements (kimijax/train/state.py): the initialisers run on the host CPU and
copied to the shards, or run on the shards themselves; the same state, in the same layout."""

import jax
import numpy as np

from kimijax.parallel import mesh as mesh_lib
from kimijax.train.state import init_state
from kimijax.train.step import build_training

from tiny_config import TINY, make_config


def test_host_init_gives_the_sharded_init_state_in_its_layout():
  config = make_config({**TINY, 'model.layer_pattern': 'KA', 'mesh.fsdp': 4, 'mesh.data': 2})
  mesh = mesh_lib.make_mesh(config.mesh)
  run = build_training(config, mesh)
  abstract = run.abstract_state
  on_mesh = init_state(run.model, run.optimizer, config, abstract, on_host=False)
  on_host = init_state(run.model, run.optimizer, config, abstract, on_host=True)
  flat = jax.tree_util.tree_flatten_with_path(on_host)[0]
  assert len(flat) == len(jax.tree.leaves(on_mesh)) > 10
  assert any(len(set(a.sharding.spec) - {None}) for _, a in flat)   # some leaves really are sharded
  for (path, a), b, want in zip(flat, jax.tree.leaves(on_mesh), jax.tree.leaves(abstract)):
    name = jax.tree_util.keystr(path)
    assert a.sharding == b.sharding == want.sharding, name
    assert (a.shape, a.dtype) == (want.shape, want.dtype), name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
