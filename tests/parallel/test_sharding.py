"""Sharded training equals one-device training, and parameters really are sharded by the rules.

On the 8 fake CPU devices of tests/conftest.py: the real jitted train step (state created in its
sharded layout, batches assembled with make_array_from_process_local_data) runs 3 steps on
data-parallel, fsdp and tensor-parallel meshes; the per-step losses and gradient norms must match
the same 3 steps on a single device to a relative 1e-5. The reference is the one-device run, which
involves no collectives or sharding at all.
"""

import math

import jax
import numpy as np
import pytest
from helpers import BATCH, RTOL, SEQ, STEPS, sharding_config, train_steps

from kimijax import config as config_lib
from kimijax.config import ConfigError
from kimijax.model import Transformer
from kimijax.optim import make_optimizer
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.state import state_shardings

# Sizes of (data, fsdp, tensor).
DP8, FSDP8, DP2_FSDP2_TP2, DP2_TP4 = (8, 1, 1), (1, 8, 1), (2, 2, 2), (2, 1, 4)

_REFERENCE = {}


def reference(variant):
  """The one-device run, computed once per variant."""
  if variant not in _REFERENCE:
    config = sharding_config(variant)
    history, state, _, _ = train_steps(config, jax.devices()[:1])
    _REFERENCE[variant] = (history, jax.tree.map(np.asarray, state.params))
  return _REFERENCE[variant]


def spec_of(x) -> tuple:
  """The array's PartitionSpec, padded with None to its rank."""
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec))


def shard_shapes(x) -> set:
  return {s.data.shape for s in x.addressable_shards}


def check_param_sharding(state, shape):
  """Parameters (and the AdamW moments) are split exactly as DEFAULT_RULES say on this mesh."""
  data, fsdp, tensor = shape
  params = state.params
  attn, mlp = params['layer_0']['attention'], params['layer_0']['mlp']
  q, k, o, embed = attn['query'], attn['key'], attn['out'], params['embed']
  gate, wo = mlp['wi_gate'], mlp['wo']
  fs = 'fsdp' if fsdp > 1 else None
  tp = 'tensor' if tensor > 1 else None

  # Compare specs ignoring mesh axes of size 1 (the rules name them whatever their size).
  def norm(spec):
    drop = {a for a, n in zip(('data', 'fsdp', 'tensor'), shape) if n == 1}
    out = []
    for s in spec:
      axes = s if isinstance(s, tuple) else (s,)
      axes = tuple(a for a in axes if a is not None and a not in drop)
      out.append(axes[0] if len(axes) == 1 else (axes or None))
    return tuple(out)

  assert norm(spec_of(q)) == (fs, tp, None), q.sharding
  assert norm(spec_of(k)) == (fs, tp, None), k.sharding
  assert norm(spec_of(o)) == (tp, None, fs), o.sharding
  assert norm(spec_of(embed)) == (tp, fs), embed.sharding
  assert norm(spec_of(gate)) == (fs, tp), gate.sharding
  assert norm(spec_of(wo)) == (tp, fs), wo.sharding
  norm_scale = jax.tree.leaves(params['layer_0']['mixer_norm'])[0]
  assert norm(spec_of(norm_scale)) == (None,), norm_scale.sharding

  # Each device holds only its slice: 1/fsdp of the 'embed' rows, 1/tensor of the heads.
  d, h, dh = q.shape
  assert shard_shapes(q) == {(d // fsdp, h // tensor, dh)}
  assert shard_shapes(k) == {(d // fsdp, k.shape[1] // tensor, dh)}
  assert shard_shapes(o) == {(h // tensor, dh, d // fsdp)}
  assert shard_shapes(embed) == {(embed.shape[0] // tensor, d // fsdp)}
  assert shard_shapes(gate) == {(d // fsdp, gate.shape[1] // tensor)}
  assert sum(s.data.size for s in q.addressable_shards) == q.size * data  # replicated over data only

  # AdamW moments live with their parameters.
  mus = [s for s in jax.tree.leaves(state.opt_state) if hasattr(s, 'sharding') and s.shape == q.shape]
  assert mus and all(shard_shapes(m) == shard_shapes(q) for m in mus)


@pytest.mark.parametrize(
  'variant,shape',
  [
    ('mha', DP8),
    ('mha', FSDP8),
    ('mha', DP2_FSDP2_TP2),
    pytest.param('mha', DP2_TP4, marks=pytest.mark.long),  # ~25 s; gqa-2x1x4 covers tensor = 4
    pytest.param('gqa', DP2_FSDP2_TP2, marks=pytest.mark.long),  # ~45 s; gqa-2x1x4 covers GQA
    ('gqa', DP2_TP4),
  ],
  ids=lambda x: x if isinstance(x, str) else 'x'.join(map(str, x)),
)
def test_sharded_training_matches_one_device(variant, shape):
  assert len(jax.devices()) == 8, 'tests/conftest.py should give 8 fake CPU devices'
  ref_history, ref_params = reference(variant)
  config = sharding_config(variant, shape)
  history, state, mesh, gbatch = train_steps(config, jax.devices())

  assert dict(mesh.shape) == dict(zip(('data', 'fsdp', 'tensor'), shape))
  assert len(mesh.devices.flat) == 8
  check_param_sharding(state, shape)
  # The batch is split over data x fsdp and replicated over tensor.
  rows = BATCH // (shape[0] * shape[1])
  assert shard_shapes(gbatch['inputs']) == {(rows, SEQ)}

  ref_losses = [float(h['loss']) for h in ref_history]
  losses = [float(h['loss']) for h in history]
  assert all(bool(h['finite']) for h in history)
  assert len(set(ref_losses)) == STEPS, f'the loss should change every step: {ref_losses}'
  np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
  np.testing.assert_allclose(
    [float(h['grad_norm']) for h in history], [float(h['grad_norm']) for h in ref_history], rtol=RTOL, atol=0
  )
  # The parameters after 3 steps agree too (the last loss only sees 2 updates). AdamW normalises
  # each update, so an entry whose gradient is ~0 may move by a different fraction of one step
  # (lr = 1e-2) under a different summation order; hence an absolute tolerance of lr / 10.
  for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(state.params)):
    np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-3, err_msg=jax.tree_util.keystr(path))


def test_fsdp8_shards_embed_rows_one_eighth():
  """The issue's explicit example: under fsdp=8 an 'embed'-axis parameter is split 8 ways."""
  config = sharding_config('mha', FSDP8)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices())
  model = Transformer(config.model)
  optimizer = make_optimizer(config)
  abstract, shardings = state_shardings(model, optimizer, config, mesh)
  w = abstract.params['layer_0']['mlp']['wi_up']  # ('embed', 'mlp')
  assert w.sharding.spec[0] == 'fsdp'
  assert w.sharding.shard_shape(w.shape) == (w.shape[0] // 8, w.shape[1])
  assert math.prod(w.sharding.shard_shape(w.shape)) * 8 == math.prod(w.shape)


def mesh_cfg(data, fsdp, tensor):
  c = config_lib.base_config().mesh
  c.data, c.fsdp, c.tensor = data, fsdp, tensor
  return c


def test_mesh_shape_resolves_minus_one():
  assert mesh_lib.mesh_shape(mesh_cfg(-1, 2, 2), 8) == (2, 2, 2)
  assert mesh_lib.mesh_shape(mesh_cfg(2, 1, -1), 8) == (2, 1, 4)
  assert mesh_lib.mesh_shape(mesh_cfg(-1, 1, 1), 1) == (1, 1, 1)


@pytest.mark.parametrize(
  'sizes,num_devices,names',
  [
    ((2, 2, 1), 8, ('mesh.data', 'mesh.fsdp', 'mesh.tensor')),  # product 4 != 8 devices
    ((4, 4, 1), 8, ('mesh.data', 'mesh.fsdp', 'mesh.tensor')),  # product 16 != 8 devices
    ((-1, -1, 1), 8, ('mesh.data', 'mesh.fsdp')),  # two -1s
    ((-1, 1, -1), 8, ('mesh.data', 'mesh.tensor')),
    ((-1, 3, 1), 8, ('mesh.fsdp',)),  # 3 does not divide 8
  ],
)
def test_mesh_shape_errors_name_keys(sizes, num_devices, names):
  with pytest.raises(ConfigError) as e:
    mesh_lib.mesh_shape(mesh_cfg(*sizes), num_devices)
  msg = str(e.value)
  for name in names:
    assert name in msg, msg
  assert str(num_devices) in msg, msg


def test_make_mesh_rejects_wrong_device_count():
  with pytest.raises(ConfigError, match='mesh.data'):
    mesh_lib.make_mesh(mesh_cfg(2, 2, 1), jax.devices())
