"""An MoE model trains the same on one device and on the 8 fake CPU devices of tests/conftest.py
with the experts split over an 'expert' mesh axis (data x expert, fsdp x expert): 3 real train
steps (tests/helpers.py), the per-step losses and gradient norms to a relative 1e-5 (float32), the
balancing biases after the steps exactly, the parameters as tests/parallel/test_sharding.py
checks them. The reference is the one-device run, with no collectives or sharding at all."""

import jax
import numpy as np
import pytest
from helpers import BATCH, RTOL, SEQ, sharding_config, train_steps

from kimijax import config as config_lib
from kimijax.parallel import mesh as mesh_lib

EXPERTS = 8
_REFERENCE = {}


def moe_config(shape=(1, 1, 1, 1)):
  """helpers' 'mha' config (2 layers, d 32) with an MoE second layer: 8 experts of hidden 16,
  top-2, 1 shared, on 'xla_blocked', the balance loss on and a bias rate large enough to move
  choices in 3 steps, on a (data, fsdp, tensor, expert) mesh."""
  c = sharding_config('mha').unlock()
  c.model.mlp_kind = 'moe'
  c.model.moe.update(
    num_experts=EXPERTS,
    top_k=2,
    num_shared=1,
    expert_hidden=16,
    aux_loss_alpha=0.01,
    bias_rate=0.01,
    scaling_factor=2.0,
    impl='xla_blocked',  # the GPU configs' grouped matmul ('xla' is covered by the op and layer tests)
  )
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = shape
  return config_lib.validate(c)


def reference():
  if not _REFERENCE:
    history, state, _, _ = train_steps(moe_config(), jax.devices()[:1])
    _REFERENCE['run'] = (history, jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, state.moe_state))
  return _REFERENCE['run']


@pytest.mark.parametrize(
  'shape', [pytest.param((2, 1, 1, 4), marks=pytest.mark.long), (1, 2, 1, 4)], ids=['data2xexpert4', 'fsdp2xexpert4']
)
def test_sharded_moe_training_matches_one_device(shape):
  assert len(jax.devices()) == 8, 'tests/conftest.py should give 8 fake CPU devices'
  ref_history, ref_params, ref_moe = reference()
  history, state, mesh, gbatch = train_steps(moe_config(shape), jax.devices())

  assert dict(mesh.shape) == dict(zip(('data', 'fsdp', 'tensor', 'expert'), shape))
  # The batch is split over every axis but tensor: the expert groups' devices carry tokens too.
  assert {s.data.shape for s in gbatch['inputs'].addressable_shards} == {(BATCH // 8, SEQ)}
  gate = state.params['layer_1']['mlp']['wi_gate']  # ('expert', 'embed', 'mlp')
  assert gate.sharding.shard_shape(gate.shape)[0] == EXPERTS // 4
  bias = state.moe_state['layer_1']['mlp']['bias']
  assert bias.sharding.is_fully_replicated

  ref_losses = [float(h['loss']) for h in ref_history]
  assert all(bool(h['finite']) for h in history)
  assert len(set(ref_losses)) == len(ref_losses), f'the loss should change every step: {ref_losses}'
  np.testing.assert_allclose([float(h['loss']) for h in history], ref_losses, rtol=RTOL, atol=0)
  np.testing.assert_allclose(
    [float(h['grad_norm']) for h in history], [float(h['grad_norm']) for h in ref_history], rtol=RTOL, atol=0
  )
  # The loads are exact integer counts over the global batch, so the biases agree exactly, and
  # they have moved (a rate of 0.01 per step, signs from the loads).
  np.testing.assert_array_equal(np.asarray(bias), ref_moe['layer_1']['mlp']['bias'])
  assert np.abs(ref_moe['layer_1']['mlp']['bias']).max() > 0
  # As tests/parallel/test_sharding.py: AdamW normalises each update, so an entry whose gradient
  # is ~0 may move by a different fraction of one step (lr 1e-2) under another summation order.
  for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-3, err_msg=jax.tree_util.keystr(path))


def test_the_expert_axis_is_in_the_mesh_only_when_used():
  mesh = config_lib.base_config().mesh
  assert mesh_lib.mesh_axes(mesh) == ('data', 'fsdp', 'tensor') and mesh_lib.mesh_shape(mesh, 8) == (8, 1, 1)
  rules = dict(mesh_lib.rules(mesh))
  assert rules['act_batch'] == ('data', 'fsdp') and rules['expert'] is None  # as before the axis existed
  mesh.expert = 4
  assert mesh_lib.mesh_axes(mesh) == ('data', 'fsdp', 'tensor', 'expert')
  assert mesh_lib.mesh_shape(mesh, 8) == (2, 1, 1, 4)
  rules = dict(mesh_lib.rules(mesh))
  assert rules['act_batch'] == ('data', 'fsdp', 'expert') and rules['expert'] == 'expert'
  mesh.data = 1
  with pytest.raises(config_lib.ConfigError, match=r'mesh.data \* mesh.fsdp \* mesh.tensor \* mesh.expert = 4'):
    mesh_lib.mesh_shape(mesh, 8)
