"""experiments/scaling_ladder.py end to end on tiny rungs (2 variants x 2 rungs, one or two steps each:
each run costs its compilations, so the fits' intervals are tested on synthetic ladders instead),
resume of a half-finished ladder, and the report's fits against the rungs it lists; the report
rebuilt from a ladder.json alone (experiments/ladder_report.py)."""

import json
import pathlib

import jax
import numpy as np
import pytest

from configs.ladder import get_config
from experiments import ladder_fit, ladder_report, runs, scaling_ladder
from kimijax.config import load_file

ONE = jax.devices()[:1]
LADDERS = str(pathlib.Path(__file__).with_name('ladder_tiny.py'))  # the tiny ladders, a ladder file


def tiny_ladder(name='tiny'):
  return load_file(f'{LADDERS}:{name}')


@pytest.mark.long
def test_ladder_runs_every_rung_reports_and_resumes(tmp_path, capsys):
  ladder = tiny_ladder()
  # A half-finished ladder: a first call for the baseline alone, whose time budget is spent after
  # its first rung (the first rung always runs: there is no rate to judge by before it).
  first = scaling_ladder.run_ladder(ladder, tmp_path, variants=['rope'], time_budget_s=0, devices=ONE)
  assert 'stopping before rung 2 of 2' in capsys.readouterr().out
  assert first['finished_rungs'] == 1 and first['planned_rungs'] == 4
  assert first['multipliers'] == {'model': {}, 'total': {}} and (tmp_path / 'ladder.md').exists()
  mtime = (tmp_path / 'rope' / 'd8' / 'done.json').stat().st_mtime
  data = scaling_ladder.run_ladder(ladder, tmp_path, devices=ONE, drop_checkpoints=True)
  out = capsys.readouterr().out
  # Asked to, the call removed the checkpoints of the rungs it finished, and only those.
  assert (tmp_path / 'rope' / 'd8' / 'checkpoints').exists()
  assert not any((tmp_path / v / r / 'checkpoints').exists() for v, r in (('rope', 'd16'), ('nope', 'd8')))
  assert 'rung 4 of 4' in out and 'ETA' in out and 'finished earlier, reused' in out
  assert (tmp_path / 'rope' / 'd8' / 'done.json').stat().st_mtime == mtime  # reused, not retrained
  done = json.loads((tmp_path / 'rope' / 'd8' / 'done.json').read_text())
  assert done['hardware'] == runs.hardware() and done['train_split_tokens'] > 0
  assert data['finished_rungs'] == 4
  for name in ('ladder.json', 'ladder.md', 'ladder.png'):
    assert (tmp_path / name).exists()
  saved = json.loads((tmp_path / 'ladder.json').read_text())
  assert [r['rung'] for r in saved['rungs']] == ['d8', 'd16'] * 2
  for variant in ('rope', 'nope'):
    rows = [r for r in saved['rungs'] if r['variant'] == variant]
    # Same tokens for both variants of a rung; params grow along the ladder.
    assert [r['tokens'] for r in rows] == [r['tokens'] for r in saved['rungs'][:2]]
    assert all(a['params'] < b['params'] for a, b in zip(rows, rows[1:]))
    assert all(r['epochs'] is not None and 0 < r['epochs'] < 1 for r in rows)
    # The reported fits are the least-squares lines through the rungs it lists, on each count of C.
    for compute, key in (('model', 'model_flops'), ('total', 'flops')):
      x = np.log([r[key] / ladder_fit.PFLOPS_DAY for r in rows])
      y = np.log([r['final_eval_loss'] for r in rows])
      slope, intercept = np.polyfit(x, y, 1)
      fit = saved['fits'][compute][variant]['power_law']
      assert fit['alpha'] == pytest.approx(-slope, rel=1e-6, abs=1e-9)
      assert fit['A'] == pytest.approx(np.exp(intercept), rel=1e-6)
      assert 'with_offset' not in saved['fits'][compute][variant]  # 2 rungs: the pure power law only
  assert set(saved['multipliers']['model']) == set(saved['multipliers']['total']) == {'nope'}
  assert set(saved['verdict']) == {'nope'} and saved['verdict_compute'] == 'model'
  md = (tmp_path / 'ladder.md').read_text()
  assert '4 of 4 rungs finished' in md and 'Compute multiplier' in md


def fake_finished_run(run_dir, config, eval_loss, hardware, split_tokens):
  """A finished run's files as train_run leaves them (config.json, metrics.jsonl, done.json)."""
  run_dir.mkdir(parents=True)
  (run_dir / 'config.json').write_text(json.dumps(runs.config_json(config)))
  steps = config.train.steps
  lines = [{'step': steps, 'loss': eval_loss + 0.1, 'tokens_per_sec': 1e6}, {'step': steps, 'eval_loss': eval_loss}]
  (run_dir / 'metrics.jsonl').write_text(''.join(json.dumps(l) + '\n' for l in lines))
  (run_dir / 'done.json').write_text(
    json.dumps({'wall_seconds': 10.0, 'hardware': hardware, 'train_split_tokens': split_tokens})
  )


def test_report_only_states_where_the_rungs_ran_and_their_epochs(tmp_path):
  """A ladder trained elsewhere (on a GPU) and brought back: --report_only trains nothing, fits the
  rungs it finds, takes each rung's hardware and training-split size from its done.json, and
  counts each rung's model and optimizer FLOPs from its config."""
  ladder = tiny_ladder('tiny_muon')
  planned = scaling_ladder.plan(ladder, tmp_path)
  losses = {('rope', 'd8'): 3.0, ('rope', 'd16'): 2.5, ('nope', 'd8'): 3.1}  # nope d16 unfinished
  for r in planned:
    if (r['variant'], r['rung']['name']) in losses:
      fake_finished_run(r['run_dir'], r['config'], losses[r['variant'], r['rung']['name']], 'GPU X x 1', 10**9)
  data = scaling_ladder.run_ladder(ladder, tmp_path, report_only=True, devices=ONE)
  assert data['finished_rungs'] == 3 and not (tmp_path / 'nope' / 'd16').exists()
  rows = {(r['variant'], r['rung']): r for r in data['rungs']}
  assert rows['rope', 'd16']['hardware'] == 'GPU X x 1'
  assert rows['rope', 'd16']['epochs'] == pytest.approx(rows['rope', 'd16']['tokens'] / 10**9)
  # Model FLOPs in closed form: a dense MHA model with tied embeddings does 6 N + 6 L T d per token
  # (docs/scaling_ladders.md#compute); AdamW adds none, Muon its Newton-Schulz.
  for (variant, _), r in rows.items():
    seq_len = ladder.base.train.seq_len
    per_token = 6 * r['params'] + 6 * r['num_layers'] * seq_len * r['d_model']
    assert r['model_flops'] == pytest.approx(r['tokens'] * per_token, rel=1e-12)
    assert r['model_flops'] + r['optimizer_flops'] == pytest.approx(r['flops'], rel=1e-12)
    assert (r['optimizer_flops'] > 0) == (variant == 'nope')
  # Two rungs of the baseline: its power law is the line through them (AdamW: the same on both counts).
  c = [rows['rope', n]['model_flops'] / ladder_fit.PFLOPS_DAY for n in ('d8', 'd16')]
  alpha = -np.log(2.5 / 3.0) / np.log(c[1] / c[0])
  for compute in ('model', 'total'):
    assert data['fits'][compute]['rope']['power_law']['alpha'] == pytest.approx(alpha, rel=1e-9)
  md = (tmp_path / 'ladder.md').read_text()
  assert 'Rungs trained on: GPU X x 1 (report written on' in md and '3 of 4 rungs finished' in md
  share = rows['nope', 'd8']['optimizer_flops'] / rows['nope', 'd8']['flops']
  assert f'({100 * share:.0f}%)' in md  # the optimizer's share of the muon rung's C


# The rung keys of a ladder.json from before the model/optimizer split (experiments/results/ladder_smoke.json).
OLD_ROW_KEYS = (
  'variant rung d_model num_layers num_heads batch_size learning_rate params tokens steps flops '
  'final_eval_loss final_train_loss epochs tokens_per_sec wall_seconds loss_by_position run_dir'
).split()


def test_a_ladder_json_from_before_the_split_still_reports(tmp_path):
  """--from_json on a ladder.json whose rungs hold only C = model + optimizer FLOPs: the split
  shows '-', the model + optimizer fits and multiplier are made (the known power law's multiplier
  in closed form), the verdict, which reads model FLOPs, says it has nothing to read."""
  c = np.geomspace(1e-9, 1e-7, 3)  # PFLOP/s-days
  rows = [
    {
      **dict.fromkeys(OLD_ROW_KEYS),
      'variant': v,
      'rung': f'd{16 * (i + 2)}',
      'd_model': 16 * (i + 2),
      'num_layers': i + 2,
      'num_heads': i + 2,
      'batch_size': 8,
      'learning_rate': 0.008,
      'params': 10**5 * (i + 1),
      'tokens': 3 * 10**5 * (i + 1),
      'steps': 100,
      'flops': ci * ladder_fit.PFLOPS_DAY,
      'final_eval_loss': float(2.6 * (k * ci) ** -0.05),
      'final_train_loss': 2.0,
    }
    for v, k in (('adamw', 1.0), ('muon', 1.5))
    for i, ci in enumerate(c)
  ]
  old = {
    'ladder': 'old',
    'rule': 'a rule',
    'tokens_per_param': 3.0,
    'baseline': 'adamw',
    'variants': {'adamw': [['optimizer.name', 'adamw']], 'muon': [['optimizer.name', 'muon']]},
    'rungs': rows,
    'fits': {},
    'multipliers': {},
    'planned_rungs': 6,
    'finished_rungs': 6,
  }
  (tmp_path / 'old.json').write_text(json.dumps(old))
  data = ladder_report.report_from_json(tmp_path / 'old.json', tmp_path / 'out')
  assert data['multipliers']['total']['muon']['multiplier'] == pytest.approx([1.5] * 3, rel=1e-6)
  assert data['fits']['model'] == {'adamw': {}, 'muon': {}} and data['multipliers']['model'] == {}
  assert data['verdict'] == {}
  md = (tmp_path / 'out' / 'ladder.md').read_text()
  assert '| - | - | - / 1e-09 |' in md  # model FLOPs, optimizer FLOPs, C model / total
  assert '| muon | model + optimizer | ' in md and '**1.5x**' in md
  assert 'no reading' in md and '6 of 6 rungs finished' in md and 'Rungs trained on: not recorded' in md
  assert "configs/ladder.py:old does not plan its rungs (configs/ladder.py: unknown variant 'old'" in md
  assert (tmp_path / 'out' / 'ladder.png').exists()


@pytest.mark.parametrize(
  'text,message',
  [
    (None, r'--from_json=\S+missing.json: cannot read it as JSON \(\[Errno 2\]'),
    ('{"ladder": ', r'--from_json=\S+: cannot read it as JSON \(Expecting value'),
    ('[1, 2]', r"--from_json=\S+: not a ladder.json of experiments/scaling_ladder.py \(it lacks \['ladder', "),
    (
      '{"ladder": "x", "rungs": []}',
      r"\(it lacks \['rule', 'tokens_per_param', 'baseline', 'variants', 'planned_rungs'\]",
    ),
  ],
  ids=['no file', 'not json', 'not an object', 'keys missing'],
)
def test_from_json_names_the_flag_and_path_of_a_file_it_cannot_use(tmp_path, text, message):
  path = tmp_path / 'missing.json'
  if text is not None:
    path = tmp_path / 'bad.json'
    path.write_text(text)
  with pytest.raises(runs.WorkflowError, match=message):
    ladder_report.report_from_json(path, tmp_path / 'out')
  assert not (tmp_path / 'out').exists()


def test_from_json_names_a_rung_that_lacks_a_key(tmp_path):
  rung = dict.fromkeys(OLD_ROW_KEYS, 1)
  del rung['final_eval_loss']
  data = {k: 1 for k in ladder_report.JSON_KEYS} | {'rungs': [dict.fromkeys(OLD_ROW_KEYS, 1), rung]}
  (tmp_path / 'l.json').write_text(json.dumps(data))
  with pytest.raises(runs.WorkflowError, match=r"l.json: its rung 1 lacks \['final_eval_loss'\]"):
    ladder_report.report_from_json(tmp_path / 'l.json', tmp_path / 'out')


def before_the_split(data: dict) -> dict:
  """A ladder.json as it was written before the model/optimizer split: rungs with OLD_ROW_KEYS
  (no model_flops, optimizer_flops, active_params, hardware), no compute counts or verdict."""
  old = {k: v for k, v in data.items() if k not in ('compute', 'verdict_compute', 'verdict')}
  return {**old, 'rungs': [{k: r[k] for k in OLD_ROW_KEYS} for r in data['rungs']]}


def same(a, b) -> bool:
  """Equal as written to ladder.json (NaN equal to NaN)."""
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_from_json_counts_the_split_again_where_the_ladder_file_reproduces_the_recorded_flops(tmp_path):
  """A ladder.json from before the split, of a ladder its ladder file still plans: --from_json gets
  back exactly the split a fresh report counted from the run folders (AdamW's model FLOPs also in
  closed form), and so the model FLOPs fits, multiplier and verdict; the header keeps the date and
  hardware of the call that wrote the ladder.json. A rung whose recorded steps or FLOPs the plan
  does not reproduce keeps '-', and the report says why."""
  ladder = tiny_ladder('tiny_muon')
  losses = {('rope', 'd8'): 3.0, ('rope', 'd16'): 2.5, ('nope', 'd8'): 2.9, ('nope', 'd16'): 2.3}
  for r in scaling_ladder.plan(ladder, tmp_path / 'runs'):
    fake_finished_run(r['run_dir'], r['config'], losses[r['variant'], r['rung']['name']], 'GPU X x 1', 10**9)
  fresh = scaling_ladder.run_ladder(ladder, tmp_path / 'runs', report_only=True, devices=ONE)
  command = 'python -m experiments.scaling_ladder --config=L:tiny_muon --workdir=W'
  old = {**before_the_split(fresh), 'date': '2020-01-02 03:04 UTC', 'hardware': 'CPU Y', 'command': command}
  (tmp_path / 'old.json').write_text(json.dumps(old))
  data = ladder_report.report_from_json(tmp_path / 'old.json', tmp_path / 'out', ladder_file=LADDERS)
  for got, want in zip(data['rungs'], fresh['rungs'], strict=True):
    assert (got['variant'], got['rung']) == (want['variant'], want['rung'])
    assert [got[k] for k in ('model_flops', 'optimizer_flops', 'active_params')] == [
      want[k] for k in ('model_flops', 'optimizer_flops', 'active_params')
    ]
    per_token = 6 * got['params'] + 6 * got['num_layers'] * ladder.base.train.seq_len * got['d_model']
    assert got['model_flops'] == pytest.approx(got['tokens'] * per_token, rel=1e-12)
    assert (got['optimizer_flops'] > 0) == (got['variant'] == 'nope')
  for key in ('fits', 'multipliers', 'verdict'):
    assert same(data[key], fresh[key])
  assert set(data['verdict']) == {'nope'}
  assert (data['date'], data['hardware'], data['ladder_command']) == ('2020-01-02 03:04 UTC', 'CPU Y', command)
  md = (tmp_path / 'out' / 'ladder.md').read_text()
  header = 'Date: 2020-01-02 03:04 UTC. Rungs trained on: not recorded (their ladder.json was written on CPU Y by'
  assert f'{header} `{command}`)' in md
  assert "FLOPs '-'" not in md

  rows = {(r['variant'], r['rung']): r for r in old['rungs']}
  rows['rope', 'd8']['steps'] += 1
  rows['nope', 'd16']['flops'] *= 1 + 1e-6
  rows['rope', 'd16']['flops'] *= 1 + 1e-12  # inside SPLIT_TOLERANCE
  (tmp_path / 'off.json').write_text(json.dumps(old))
  data = ladder_report.report_from_json(tmp_path / 'off.json', tmp_path / 'off', ladder_file=LADDERS)
  got = {(r['variant'], r['rung']): r for r in data['rungs']}
  want = {(r['variant'], r['rung']): r for r in fresh['rungs']}
  for key in (('rope', 'd8'), ('nope', 'd16')):
    assert got[key]['model_flops'] is None and got[key]['optimizer_flops'] is None
  for key in (('rope', 'd16'), ('nope', 'd8')):
    for split in ('model_flops', 'optimizer_flops'):
      assert got[key][split] == want[key][split]
  assert data['verdict'] == {}  # one rung per variant left on model FLOPs: no fit
  md = (tmp_path / 'off' / 'ladder.md').read_text()
  [why] = [line for line in md.splitlines() if line.startswith("Model and optimizer FLOPs '-'")]
  assert f'{LADDERS}:tiny_muon does not reproduce these rungs: ' in why
  assert 'rope d8: planned steps=1, params=2920; recorded steps=2, params=2920' in why
  assert 'nope d16: planned ' in why and '(relative difference 1e-06)' in why
  assert 'rope d16' not in why and 'nope d8' not in why


def test_ladder_refuses_unknown_variant_and_folder_of_another_config(tmp_path):
  ladder = tiny_ladder()
  with pytest.raises(runs.WorkflowError, match="'sgd' is not a variant"):
    scaling_ladder.plan(ladder, tmp_path, ['sgd'])
  run_dir = tmp_path / 'rope' / 'd8'
  run_dir.mkdir(parents=True)
  (run_dir / 'config.json').write_text(json.dumps({'seed': 123}))
  with pytest.raises(runs.WorkflowError, match='holds a run of another config'):
    scaling_ladder.plan(ladder, tmp_path)
  assert (run_dir / 'config.json').read_text() == json.dumps({'seed': 123})  # left as it was


def test_a_run_from_before_a_config_key_existed_is_the_same_run(tmp_path):
  """A run folder whose config.json lacks a key added to the schema later (its default value
  here) is reused, not refused; a different value for it is named (a notice for an implementation
  key, which changes how, not what; an error for a model key)."""
  config = tiny_ladder().base
  saved = runs.config_json(config)
  del saved['model']['short_conv_impl']
  del saved['model']['kda_output_gate']
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert runs.check_folder(tmp_path, config) == []
  config.model.short_conv_impl = 'pallas'
  assert any("model.short_conv_impl: 'xla' -> 'pallas'" in n for n in runs.check_folder(tmp_path, config))
  config.model.kda_output_gate = 'swish'
  with pytest.raises(runs.WorkflowError, match="model.kda_output_gate: 'sigmoid' -> 'swish'"):
    runs.check_folder(tmp_path, config)


def test_a_run_saved_under_a_former_key_name_is_the_same_run(tmp_path):
  """model.short_conv_impl was model.kda_conv_impl: a config.json with the former name reads as
  the same config (run folders and --mode=eval), and a different value under it is named as the
  key is now."""
  from kimijax.train.checkpoint import load_run_config

  config = tiny_ladder().base
  saved = runs.config_json(config)
  del saved['model']['short_conv_impl']
  saved['model']['kda_conv_impl'] = 'pallas'
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert load_run_config(tmp_path).model.short_conv_impl == 'pallas'
  saved['model']['kda_conv_impl'] = 'xla'
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert runs.check_folder(tmp_path, config) == []
  config.model.short_conv_impl = 'pallas'
  assert any("model.short_conv_impl: 'xla' -> 'pallas'" in n for n in runs.check_folder(tmp_path, config))


@pytest.mark.parametrize(
  'name', ['smoke', 'smoke_moe', 'gpu', 'gpu_attnres', 'gpu_hybrid', 'gpu_moe'], ids=lambda n: f'ladder_{n}'
)  # an id 'gpu' would mark it GPU-only
def test_every_named_ladder_plans_by_its_rule(tmp_path, name):
  """Every rung of every ladder is a valid config (GPU ones too, counted on the CPU), tokens are
  tokens_per_param x the baseline's parameters, and the rule ties width, depth and heads."""
  ladder = get_config(name)
  planned = scaling_ladder.plan(ladder, tmp_path)
  assert len(planned) == len(ladder.rungs) * len(ladder.variants) and len(ladder.rungs) >= 3
  base_runs = [r for r in planned if r['variant'] == ladder.baseline]
  for r in base_runs:
    t = r['config'].train
    tokens = t.steps * t.batch_size * t.seq_len
    needed = ladder.tokens_per_param * r['step_flops']['params']
    assert needed <= tokens < needed + t.batch_size * t.seq_len
    m = r['config'].model
    assert m.d_model // m.num_heads in (16, 64) and m.mlp_dim == 3 * m.d_model
  widths = [r['config'].model.d_model for r in base_runs]
  assert widths == sorted(widths)


@pytest.mark.parametrize(
  'name,platform', [('smoke_moe', 'cpu'), ('gpu_moe', 'gpu')], ids=['ladder_smoke_moe', 'ladder_gpu_moe']
)  # an id 'gpu' would mark it GPU-only
def test_moe_ladders_match_the_arms_on_active_parameters(tmp_path, name, platform):
  """dense against moe: the same tokens per rung, active parameters apart by the routers alone
  (D x 16 per layer), the 14 idle experts' 3 D F (F = D) per layer on top of them in the total,
  the same moe arm in both ladders, and a grouped matmul that runs on the ladder's platform."""
  from kimijax.ops import moe as moe_ops

  ladder = get_config(name)
  assert ladder.baseline == 'dense' and ladder.variants['moe'] == get_config('gpu_moe').variants['moe']
  planned = {(r['variant'], r['rung']['name']): r for r in scaling_ladder.plan(ladder, tmp_path)}
  for rung_ in ladder.rungs:
    dense, moe = planned['dense', rung_['name']], planned['moe', rung_['name']]
    assert dense['config'].train.steps == moe['config'].train.steps
    assert dense['config'].optimizer.name == moe['config'].optimizer.name == 'muon'
    d, layers = rung_['d_model'], rung_['num_layers']
    assert moe['step_flops']['active_params'] - dense['step_flops']['params'] == layers * 16 * d
    assert moe['step_flops']['params'] - moe['step_flops']['active_params'] == layers * 14 * 3 * d * d
    m = moe['config'].model
    assert moe_ops.unsupported(m.moe.impl, m.compute_dtype, m.d_model, d, platform=platform) is None
    # on a CPU 'xla_blocked' runs many times faster than 'xla'; on a GPU the Mosaic GPU kernels
    # run fastest (experiments/results/moe.md)
    assert m.moe.impl == {'cpu': 'xla_blocked', 'gpu': 'mosaic'}[platform]


def test_a_run_saved_before_a_key_changed_type_reads_as_the_same_config(tmp_path):
  """model.kda_recompute_projections was a bool before it named the projections: a saved False
  is '' and True is 'qkv', for run folders and for loading a run's config (--mode=eval)."""
  from kimijax.train.checkpoint import load_run_config

  config = tiny_ladder().base
  for legacy, now in ((False, ''), (True, 'qkv')):
    saved = runs.config_json(config)
    saved['model']['kda_recompute_projections'] = legacy
    (tmp_path / 'config.json').write_text(json.dumps(saved))
    config.model.kda_recompute_projections = now
    assert runs.check_folder(tmp_path, config) == []
    assert load_run_config(tmp_path).model.kda_recompute_projections == now
  config.model.kda_recompute_projections = 'qk'  # how, not what: a notice, as on resume
  notices = runs.check_folder(tmp_path, config)
  assert any("model.kda_recompute_projections: 'qkv' -> 'qk'" in n for n in notices)
