"""kimijax/train/step.py's train.log_max_logits: with it off and no QK-Clip, nothing computes max
logits (the attention op is asked for none, in the train and the eval step alike) and no
'max_logit' is logged; with either on they are computed and reach the optimizer and the log.
Traced with eval_shape, so nothing compiles."""

import contextlib
import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.model import Transformer
from kimijax.ops import attention as attention_ops
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.loop import _train_record
from kimijax.train.step import build_training, computes_max_logits, make_eval_step, make_train_step


def tiny(kind='mha', optimizer='adamw', log=True):
  c = config_lib.base_config()
  c.model.update(d_model=32, num_layers=2, num_heads=2, mlp_dim=64, attention_kind=kind)
  c.train.update(seq_len=16, batch_size=2, log_max_logits=log)
  c.optimizer.name = optimizer
  return config_lib.validate(c)


@contextlib.contextmanager
def spy_on_attention(monkeypatch):
  """Records return_max_logits of every call to the 'xla' attention while tracing."""
  asked = []
  real = attention_ops.IMPLS['xla']

  def spy(q, k, v, causal, scale, return_max_logits, spec):
    asked.append(return_max_logits)
    return real.attention(q, k, v, causal, scale, return_max_logits, spec)

  spied = dict(attention_ops.IMPLS, xla=dataclasses.replace(real, attention=spy))
  monkeypatch.setattr(attention_ops, 'IMPLS', types.MappingProxyType(spied))
  yield asked


def trace_steps(config):
  """(metrics of the train step, eval step's outputs) as shapes, for build_training's model;
  nothing compiles."""
  import flax.linen as nn

  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  run = build_training(config, mesh)
  t = config.train
  batch = {
    'inputs': jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32),
    'targets': jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32),
    'mask': jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.float32),
  }
  train_step = make_train_step(run.model, run.optimizer, run.schedule)
  with jax.set_mesh(mesh), nn.logical_axis_rules(mesh_lib.rules(config.mesh)):
    _, metrics = jax.eval_shape(train_step, run.abstract_state, batch)
    return metrics, jax.eval_shape(make_eval_step(run.model), run.abstract_state.params, batch)


@pytest.mark.parametrize(
  'log,optimizer,want',
  [
    (True, 'adamw', True),
    (False, 'adamw', False),
    (False, 'muon', False),
    (False, 'muonclip', True),
    (True, 'muonclip', True),
  ],
)
def test_max_logits_are_computed_for_the_log_or_for_qk_clip(log, optimizer, want):
  assert computes_max_logits(tiny(optimizer=optimizer, log=log)) is want


@pytest.mark.parametrize('kind', ['mha', 'mla'])
def test_with_logging_and_qk_clip_off_no_max_logit_work_runs(kind, monkeypatch):
  with spy_on_attention(monkeypatch) as asked:
    metrics, _ = trace_steps(tiny(kind, log=False))
  assert asked and not any(asked)  # forward (train and eval): never asked for them
  assert 'max_logits' not in metrics
  record = _train_record(1, {**{k: np.float32(0) for k in ('loss', 'lr', 'grad_norm')}})
  assert not any(key.startswith('max_logit') for key in record)


@pytest.mark.parametrize('optimizer,log', [('adamw', True), ('muonclip', False)])
def test_with_logging_or_qk_clip_on_they_are_computed_and_reported(optimizer, log, monkeypatch):
  with spy_on_attention(monkeypatch) as asked:
    metrics, _ = trace_steps(tiny(optimizer=optimizer, log=log))
  assert asked == [True] * 4 + [False] * 2  # each layer at init and in the train step; none in eval
  assert sorted(metrics['max_logits']) == ['layer_0', 'layer_1']
  assert all(m.shape == (2,) for m in metrics['max_logits'].values())
  record = _train_record(
    1,
    {
      **{k: np.float32(0) for k in ('loss', 'lr', 'grad_norm')},
      'max_logits': {'layer_0': np.array([1.0, 3.0]), 'layer_1': np.array([2.0, 0.5])},
    },
  )
  assert record['max_logit'] == 3.0 and record['max_logit_layer_1'] == 2.0


def test_qk_clip_without_max_logits_is_an_error():
  config = tiny(optimizer='muonclip', log=False)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  with pytest.raises(ValueError, match="muonclip' needs the model's max logits"):
    build_training(config, mesh, Transformer(config.model, max_logits=False))
