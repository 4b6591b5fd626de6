"""experiments/ablations/: the fixed verdict rule on hand-made seed values, every arm of every
ablation file is a valid config at both scales and a different experiment from its other arms,
with each claim naming arms that exist, the
AttnRes file's arms are the paper table's, the two ablated switches included, the MoE balancing
arms differ from their base in the two balancing keys alone, and the late MoE load metric is the
mean of the last fifth's logged loads (a dense model under its claims stops before training), and
the MoE sparsity arms differ in the number of routed experts alone, at equal active parameters but
for the router."""

import pytest

from experiments.ablations import (
  attention_residuals,
  common,
  kimi_linear_table1,
  long_context,
  moe_balance,
  moe_sparsity,
  mqar_recall,
  muon_update_rms,
  qk_clip,
)
from experiments.sweep import run_config
from kimijax.config import validate


def test_verdict_rule():
  # Lower is better, published a < b.
  assert common.verdict([1.0, 1.02], [1.5, 1.48], '<') == 'reproduces'
  assert common.verdict([1.5, 1.48], [1.0, 1.02], '<') == 'refuted'
  # Gap 0.01; standard error of the difference sqrt(0.02^2/2 * 2) = 0.02: inside 2 SE.
  assert common.verdict([1.00, 1.04], [1.01, 1.05], '<') == 'inside seed noise'
  assert common.verdict([1.00, 1.04], [1.01, 1.05], '=') == 'reproduces (inside seed noise)'
  assert common.verdict([1.0, 1.01], [2.0, 2.01], '=') == 'refuted'
  assert common.verdict([0.9, 0.92], [0.5, 0.52], '>') == 'reproduces'
  assert common.verdict([1.0], [1.1], '<') == 'reproduces (1 seed: noise not measured)'
  assert common.verdict([1.0], [1.1], '=').startswith('no verdict')
  assert common.verdict([1.0, 1.0], [1.0, 1.0], '>') == 'tie (equal means)'
  with pytest.raises(ValueError):
    common.verdict([1.0], [1.0], '<=')


def _what_it_trains(config) -> str:
  """The config without the keys that choose only how to compute (kimijax.train.checkpoint.MAY_DIFFER),
  as comparable text: two arms with the same text are the same experiment."""
  from kimijax.train.checkpoint import MAY_DIFFER

  d = config.to_dict()
  for key in MAY_DIFFER:
    *groups, name = key.split('.')
    node = d
    for group in groups:
      node = node[group]
    node.pop(name, None)
  return repr(sorted((k, repr(v)) for k, v in d.items()))


CASES = [
  (kimi_linear_table1, kimi_linear_table1.ARMS, kimi_linear_table1.CLAIMS),
  (attention_residuals, attention_residuals.ARMS, attention_residuals.CLAIMS),
  (muon_update_rms, muon_update_rms.ARMS, muon_update_rms.CLAIMS),
  (qk_clip, qk_clip.ARMS, qk_clip.CLAIMS),
  (long_context, long_context.ARMS, long_context.CLAIMS),
]


@pytest.mark.parametrize('scale', ['cpu', 'gpu'], ids=['cpu_scale', 'h200_scale'])  # an id 'gpu' would mark it GPU-only
def test_every_arm_is_a_valid_config_and_every_claim_names_arms(scale):
  cases = CASES + [
    (mqar_recall, mqar_recall.arms(scale), mqar_recall.claims(scale)),
    (moe_balance, moe_balance.arms(scale), moe_balance.CLAIMS),
    (moe_sparsity, moe_sparsity.arms(scale), moe_sparsity.CLAIMS),
  ]
  for module, arms, claims in cases:
    base = validate(module.base(scale))
    names = [a.name for a in arms]
    assert len(set(names)) == len(names)
    seen = {}
    for arm in arms:
      if arm.runnable:
        what = _what_it_trains(run_config(base, arm.overrides, 0))
        assert what not in seen, f'{module.__name__}: arms {seen.get(what)!r} and {arm.name!r} train the same model'
        seen[what] = arm.name
    for claim in claims:
      assert claim.a in names and claim.b in names, (module.__name__, claim)


@pytest.mark.parametrize('scale', ['cpu', 'gpu'], ids=['cpu_scale', 'h200_scale'])
def test_attention_residuals_runs_every_arm_of_the_paper_table(scale):
  """The AttnRes file's arms are the paper's (docs/attention_residuals.md), all runnable: standard, Full, Block
  S = 2 / 4 / 8 / 16, and Full without the key norm and with sigmoid weights, those two on the
  XLA path at both scales (the gpu base picks the Pallas kernels, which implement neither)."""
  arms = {a.name: a for a in attention_residuals.ARMS}
  assert list(arms) == ['standard', 'full', 'block2', 'block4', 'block8', 'block16', 'no_key_norm', 'sigmoid']
  assert all(a.runnable and a.published for a in arms.values())
  base = validate(attention_residuals.base(scale))
  model = {name: run_config(base, arm.overrides, 0).model for name, arm in arms.items()}
  for name, want in (('full', (True, 'softmax')), ('no_key_norm', (False, 'softmax')), ('sigmoid', (True, 'sigmoid'))):
    m = model[name]
    assert (m.residual, m.attnres_impl) == ('attnres_full', 'xla'), name
    assert (m.attnres_key_norm, m.attnres_depth_weights) == want, name
  for s in (2, 4, 8, 16):
    m = model[f'block{s}']
    assert (m.residual, m.attnres_block_size, m.attnres_key_norm, m.attnres_depth_weights) == (
      'attnres_block',
      s,
      True,
      'softmax',
    )
  claims = {(c.a, c.relation, c.b) for c in attention_residuals.CLAIMS}
  assert {
    ('full', '<', 'no_key_norm'),
    ('full', '<', 'sigmoid'),
    ('no_key_norm', '<', 'standard'),
    ('sigmoid', '<', 'standard'),
  } <= claims


def _flat(config) -> dict:
  out = {}

  def walk(node, prefix):
    for key, value in node.items():
      if isinstance(value, dict):
        walk(value, f'{prefix}{key}.')
      else:
        out[prefix + key] = value

  walk(config.to_dict(), '')
  return out


@pytest.mark.parametrize('scale', ['cpu', 'gpu'], ids=['cpu_scale', 'h200_scale'])
def test_moe_balance_arms_differ_only_in_the_balancing_keys(scale):
  """Each arm is the base MoE model with its bias step (model.moe.bias_rate) and balance-loss weight
  (model.moe.aux_loss_alpha) as the docstring states them, every other key the base's: the loss-free
  paper's expert layout, and the 'xla_blocked' grouped matmul at both scales."""
  base = validate(moe_balance.base(scale))
  gamma = {'cpu': 1e-2, 'gpu': 1e-3}[scale]
  want = {'bias': (gamma, 0.0), 'aux_loss': (0.0, 1e-3), 'none': (0.0, 0.0), 'bias+aux': (gamma, 1e-4)}
  arms = {a.name: a for a in moe_balance.arms(scale)}
  assert list(arms) == list(want) and all(a.runnable and a.published for a in arms.values())
  reference = _flat(run_config(base, {}, 0))
  for name, arm in arms.items():
    config = run_config(base, arm.overrides, 0)
    flat = _flat(config)
    assert flat.keys() == reference.keys(), name
    changed = {k for k in reference if flat[k] != reference[k]}
    assert changed <= {'model.moe.bias_rate', 'model.moe.aux_loss_alpha'}, (name, changed)
    assert (config.model.moe.bias_rate, config.model.moe.aux_loss_alpha) == want[name], name
  m = base.model
  layout = (m.mlp_kind, m.moe.num_experts, m.moe.top_k, m.moe.num_shared, m.moe.score_func)
  assert layout == ('moe', 64, 6, 2, 'sigmoid')
  assert m.moe.impl == 'xla_blocked'
  assert {c.metric for c in moe_balance.CLAIMS} == {'moe_load_max_mean_late', 'final_eval_loss'}


def _model_parameters(config) -> int:
  """The parameters of the model the config builds, summed from its initialised shapes."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from kimijax.config import portable
  from kimijax.model import Transformer

  model = Transformer(portable(config.model))
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  return sum(leaf.size for leaf in jax.tree.leaves(nn.unbox(shapes['params'])))


@pytest.mark.parametrize('scale', ['cpu', 'gpu'], ids=['cpu_scale', 'h200_scale'])
def test_moe_sparsity_arms_differ_only_in_the_number_of_experts(scale):
  """Each arm is the base MoE model with model.moe.num_experts = 12, 24, 48, 96 at top-6 (sparsity 2,
  4, 8, 16), every other key the base's. From the config's sizes (D, F, K, the MoE layers), the
  model's parameters grow by (3 D F + D) per expert per MoE layer (an expert's SwiGLU and its router
  column) and a token's parameters, the total less the (E - K) 3 D F of the experts it does not use,
  are equal across arms but for the router's D E; kimijax's counts (parameter_counts, the FLOPs'
  active_params) agree with these."""
  from kimijax.model import parameter_counts
  from kimijax.train.flops import training_flops_per_step

  base = validate(moe_sparsity.base(scale))
  arms = {a.name: a for a in moe_sparsity.arms(scale)}
  assert list(arms) == ['e12', 'e24', 'e48', 'e96'] and all(a.runnable and a.published for a in arms.values())
  m = base.model
  layout = (m.mlp_kind, m.moe.top_k, m.moe.num_shared, m.moe.score_func, m.moe.n_group, m.moe.bias_rate)
  assert layout == ('moe', 6, 2, 'sigmoid', 1, 1e-3)
  assert m.moe.impl == 'xla_blocked'
  d, f, k = m.d_model, m.moe.expert_hidden, m.moe.top_k
  moe_layers = m.num_layers - m.moe.first_dense_layers
  assert f > 0 and moe_layers > 0

  reference = _flat(run_config(base, {}, 0))
  totals, tokens_parameters = {}, {}
  for name, arm in arms.items():
    config = run_config(base, arm.overrides, 0)
    flat = _flat(config)
    assert flat.keys() == reference.keys(), name
    changed = {key for key in reference if flat[key] != reference[key]}
    assert changed <= {'model.moe.num_experts'}, (name, changed)
    e = config.model.moe.num_experts
    assert (f'e{e}', e // k, e % k) == (name, {12: 2, 24: 4, 48: 8, 96: 16}[e], 0)
    total = _model_parameters(config)
    active = total - moe_layers * (e - k) * 3 * d * f
    totals[e], tokens_parameters[e] = total, active - moe_layers * d * e  # the router aside
    counts = parameter_counts(config.model)
    assert (counts['total'], counts['active']) == (total, active), name
    assert training_flops_per_step(config)['active_params'] == active, name
    assert counts['moe router'] == moe_layers * d * e, name
  assert len(set(tokens_parameters.values())) == 1, tokens_parameters
  experts = sorted(totals)
  for fewer, more in zip(experts, experts[1:]):
    assert totals[more] - totals[fewer] == moe_layers * (more - fewer) * (3 * d * f + d)
  assert {(c.a, c.relation, c.b) for c in moe_sparsity.CLAIMS} == {
    ('e24', '<', 'e12'),
    ('e48', '<', 'e24'),
    ('e96', '<', 'e48'),
    ('e96', '<', 'e12'),
  }


def test_late_moe_load_is_the_mean_of_the_last_fifth():
  """100 steps logged every 10 (and at step 1): the last fifth is the steps past 80, i.e. 90 and 100,
  so the figure is (1.5 + 1.25) / 2 = 1.375 for the first seed and (2.0 + 3.0) / 2 = 2.5 for the second."""
  steps = [1] + list(range(10, 101, 10))
  first = [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.75, 1.5, 1.25]
  second = [9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.0, 2.0, 3.0]
  point = {
    'runs': [
      {'run_dir': 'a', 'steps': 100, 'curves': {'moe_load_max_mean': list(zip(steps, first))}},
      {'run_dir': 'b', 'steps': 100, 'curves': {'moe_load_max_mean': list(zip(steps, second))}},
    ]
  }
  assert common.metric_values(point, 'moe_load_max_mean_late') == [1.375, 2.5]
  dense = {'runs': [{'run_dir': 'c', 'steps': 100, 'curves': {'moe_load_max_mean': []}}]}
  with pytest.raises(ValueError, match='no moe_load_max_mean'):
    common.metric_values(dense, 'moe_load_max_mean_late')


def test_read_run_keeps_the_moe_load_curve(tmp_path):
  """runs.read_run records metrics.jsonl's moe_load_max_mean as a curve and its last value, and an
  empty curve for a run that logged none."""
  import json

  from experiments import runs
  from kimijax.config import load

  config = validate(load('configs/moonlight_small.py'))
  config.train.steps = 20
  lines = [
    {'step': 1, 'loss': 5.0, 'moe_load_max_mean': 9.0},
    {'step': 10, 'loss': 3.0, 'moe_load_max_mean': 4.0},
    {'step': 20, 'loss': 2.5, 'moe_load_max_mean': 2.5},
    {'step': 20, 'eval_loss': 2.4, 'eval_accuracy': 0.4},
  ]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
  (tmp_path / 'done.json').write_text(json.dumps({'train_split_tokens': 10**6}))
  figures = runs.read_run(config, tmp_path)
  assert figures['curves']['moe_load_max_mean'] == [(1, 9.0), (10, 4.0), (20, 2.5)]
  assert figures['moe_load_max_mean_final'] == 2.5

  dense = validate(load('configs/default.py'))
  dense.train.steps = 20
  for line in lines:
    line.pop('moe_load_max_mean', None)
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(line) + '\n' for line in lines))
  figures = runs.read_run(dense, tmp_path)
  assert figures['curves']['moe_load_max_mean'] == [] and figures['moe_load_max_mean_final'] is None


def test_moe_load_claims_on_a_dense_model_stop_before_training(tmp_path):
  """--config.model.mlp_kind=dense on the MoE balancing ablation: one WorkflowError naming the arm and
  the key, before any arm trains (the workdir holds no run)."""
  from experiments.runs import WorkflowError, with_overrides

  config = with_overrides(moe_balance.base('cpu'), {'model.mlp_kind': 'dense'})
  arms = moe_balance.arms('cpu')
  with pytest.raises(WorkflowError, match=r"arm 'bias' has model.mlp_kind='dense'"):
    common.run('t', config, arms, arms, moe_balance.CLAIMS, '', seeds=1, workdir=tmp_path)
  assert not any(tmp_path.iterdir())
