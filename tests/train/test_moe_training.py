"""Training an MoE model through the real loop (kimijax.train.loop.train) and train step: a run
checkpointed and resumed continues the same loss curve and the same balancing biases as a
straight run; metrics.jsonl carries the MoE layers' statistics; evaluation and generation of the
run pass its biases; the bias update in the train step drives an imbalanced router towards
balance. Tiny model (d_model 64, a dense layer then an MoE layer) on one CPU device; every
reference is a separate run, never the code path under test."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import persistent_compile_cache

from configs.default import get_config
from kimijax import config as config_lib
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.loop import train
from kimijax.train.metrics import read_metrics
from kimijax.train.step import build_training

MOE = {
  'model.d_model': 64,
  'model.num_layers': 2,
  'model.num_heads': 2,
  'model.mlp_dim': 128,
  'model.mlp_kind': 'moe',
  'model.moe.num_experts': 4,
  'model.moe.top_k': 2,
  'model.moe.expert_hidden': 32,
  'model.moe.aux_loss_alpha': 0.01,
  'model.moe.bias_rate': 0.01,
  'train.seq_len': 32,
  'train.batch_size': 4,
  'train.eval_batches': 1,
  'train.plot': False,
  'train.log_every': 1,
  # A constant lr: the schedule does not depend on train.steps, so a resumed run follows the straight one.
  'optimizer.schedule': 'constant',
  'optimizer.warmup_steps': 0,
  'optimizer.name': 'muon',
  'train.steps': 6,
  'train.eval_every': 3,
  'train.checkpoint_every': 3,
}


def moe_config(overrides=None):
  c = get_config()
  for key, value in {**MOE, **(overrides or {})}.items():
    config_lib.override(c, key, value)
  return config_lib.validate(c)


@pytest.fixture(scope='module', autouse=True)
def compile_cache(tmp_path_factory):
  """A persistent XLA cache for this module (helpers.persistent_compile_cache): each train() call
  jits afresh, and compiling dominates on 2 CPU cores."""
  with persistent_compile_cache(tmp_path_factory.mktemp('xla_cache')):
    yield


@pytest.fixture(scope='module')
def straight(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('straight')
  summary = train(moe_config(), workdir, devices=jax.devices()[:1])
  return workdir, summary


def saved_bias(workdir, step):
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as reader:
    tree = reader.restore(workdir.absolute() / 'checkpoints' / str(step) / 'state')
  return np.asarray(tree['moe_state']['layer_1']['mlp']['bias'])


def test_resumed_run_continues_the_loss_and_the_biases(straight, tmp_path):
  reference, _ = straight
  train(moe_config({'train.steps': 3}), tmp_path, devices=jax.devices()[:1])
  train(moe_config(), tmp_path, devices=jax.devices()[:1])  # resumes from step 3
  losses = lambda w: {r['step']: r['loss'] for r in read_metrics(w) if 'loss' in r}
  want, got = losses(reference), losses(tmp_path)
  assert sorted(got) == list(range(1, 7))
  assert [got[s] for s in range(4, 7)] == [want[s] for s in range(4, 7)]
  np.testing.assert_array_equal(saved_bias(tmp_path, 6), saved_bias(reference, 6))
  assert np.abs(saved_bias(reference, 6)).max() > 0 and not np.array_equal(
    saved_bias(reference, 3), saved_bias(reference, 6)
  )


def test_metrics_carry_the_moe_statistics(straight):
  workdir, summary = straight
  assert summary['active_params'] < summary['params']
  record = next(r for r in read_metrics(workdir) if r.get('step') == 6 and 'loss' in r)
  for key in ('load_max_mean', 'load_cv', 'router_entropy', 'bias_range', 'aux_loss'):
    assert f'moe_{key}_layer_1' in record, key
    assert f'moe_{key}_layer_0' not in record  # the dense first layer
  assert record['moe_load_max_mean'] == record['moe_load_max_mean_layer_1'] >= 1.0
  assert 0 < record['moe_router_entropy_layer_1'] <= np.log(4) + 1e-6
  assert record['moe_aux_loss'] == pytest.approx(record['moe_aux_loss_layer_1'])
  # The bias moved by 0.01 per step from zero: after 6 steps its range is a multiple of 0.01.
  assert record['moe_bias_range_layer_1'] == pytest.approx(0.01 * round(record['moe_bias_range_layer_1'] / 0.01))


def test_evaluation_and_generation_use_the_runs_biases(straight):
  from kimijax.infer.generate import generate, load_for_generation
  from kimijax.train.evaluate import evaluate_run

  workdir, summary = straight
  result = evaluate_run(workdir)
  assert result['step'] == 6 and result['eval_loss'] == pytest.approx(summary['eval_loss'], rel=1e-5)
  _, model, weights = load_for_generation(workdir)
  np.testing.assert_array_equal(weights['moe_state']['layer_1']['mlp']['bias'], saved_bias(workdir, 6))
  out = generate(model, weights, np.array([[5, 9, 2]], np.int32), max_new_tokens=3, temperature=0.0)
  assert out.shape == (1, 6)


def test_the_bias_update_balances_an_imbalanced_router():
  """Every token's router favours expert 0 (its bias starts 0.5 above the others, more than any
  score gap), so expert 0 takes a row of every token: load max / mean = 2 with top-2 of 4. The
  parameters barely move (lr 1e-6); the train step's bias update (0.02 a step) alone brings expert
  0's bias back to the others' and the loads near balance: max / mean below 1.5 on average over
  the last 10 steps (each batch of 128 random tokens routes differently, so it stays above 1)."""
  config = moe_config({'optimizer.learning_rate': 1e-6, 'model.moe.bias_rate': 0.02, 'model.moe.aux_loss_alpha': 0.0})
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  run = build_training(config, mesh)
  state = run.init_state(config)
  bias = jnp.asarray([0.5, 0.0, 0.0, 0.0], jnp.float32)
  state = state.replace(moe_state={'layer_1': {'mlp': {'bias': bias}}})
  rng = np.random.default_rng(0)
  loads = []
  for _ in range(40):
    tokens = rng.integers(0, 256, (4, 33)).astype(np.int32)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'mask': np.ones((4, 32), np.float32)}
    state, metrics = run.train_step(state, jax.device_put(batch, run.batch_sharding))
    loads.append(float(metrics['moe']['layer_1']['load_max_over_mean']))
  assert loads[0] == 2.0
  assert np.mean(loads[-10:]) <= 1.5, loads
  bias = np.asarray(state.moe_state['layer_1']['mlp']['bias'])
  assert abs(bias[0] - bias[1:].mean()) < 0.1, bias
