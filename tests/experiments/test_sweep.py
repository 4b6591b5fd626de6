"""experiments/sweep.py end to end on MQAR with a tiny model: 2 points x 2 seeds, the table's
means and spreads against the runs' own metrics.jsonl, recall accuracy logged, a finished sweep
reused, a half-finished run resumed to the same final loss, and bad input refused before training."""

import json
import pathlib
import re
import shutil
import statistics

import jax
import pytest
from helpers import cpu_subprocess_env
from tiny_config import make_config

from experiments import runs, sweep

ONE = jax.devices()[:1]
TINY_MQAR = {
  'model.d_model': 32,
  'model.num_layers': 1,
  'model.num_heads': 2,
  'model.mlp_dim': 64,
  'train.seq_len': 32,
  'train.batch_size': 4,
  'train.eval_batches': 1,
  'train.plot': False,
  'train.log_every': 1,
  'train.steps': 4,
  'train.eval_every': 2,
  'train.checkpoint_every': 2,
  'data.source': 'mqar',
  'data.mqar_num_pairs': 4,
}


def eval_records(run_dir):
  return [json.loads(l) for l in (run_dir / 'metrics.jsonl').read_text().splitlines() if 'eval_loss' in l]


@pytest.mark.long
def test_sweep_table_resume_and_reuse(tmp_path, capsys):
  config = make_config(TINY_MQAR)
  axes = sweep.parse_axes(['optimizer.learning_rate=1e-3,1e-2'], config)
  assert axes == [('optimizer.learning_rate', [1e-3, 1e-2])]
  data = sweep.run_sweep(config, axes, seeds=2, workdir=tmp_path, devices=ONE)
  assert [p['label'] for p in data['points']] == ['learning_rate=0.001', 'learning_rate=0.01']
  md = (tmp_path / 'sweep.md').read_text()
  assert 'recall accuracy' in md and (tmp_path / 'loss_curves.png').exists()
  for point in data['points']:
    finals = []
    for seed in (0, 1):
      run_dir = tmp_path / 'runs' / f'{point["label"]},seed={seed}'
      last = eval_records(run_dir)[-1]
      assert last['step'] == 4 and 0.0 <= last['eval_recall_accuracy'] <= 1.0
      finals.append(last['eval_loss'])
    row = next(l for l in md.splitlines() if l.startswith(f'| {point["label"]} |'))
    cells = [c.strip() for c in row.split('|')]
    assert cells[2] == '2'
    assert cells[4] == f'{statistics.fmean(finals):.4f} ± {statistics.stdev(finals):.4f}'
  assert data['points'][0]['runs'][0]['seed'] != data['points'][0]['runs'][1]['seed']
  assert data['points'][0]['runs'][0]['final_eval_loss'] != data['points'][0]['runs'][1]['final_eval_loss']

  # Half-finished: drop one run's last checkpoint and its done marker; the sweep resumes it from
  # step 2 and reproduces the uninterrupted final loss. The other runs are reused untouched.
  victim = tmp_path / 'runs' / 'learning_rate=0.01,seed=1'
  before = eval_records(victim)[-1]['eval_loss']
  shutil.rmtree(victim / 'checkpoints' / '4')
  (victim / 'done.json').unlink()
  kept = tmp_path / 'runs' / 'learning_rate=0.001,seed=0' / 'done.json'
  kept_mtime = kept.stat().st_mtime
  capsys.readouterr()
  again = sweep.run_sweep(config, axes, seeds=2, workdir=tmp_path, devices=ONE)
  out = capsys.readouterr().out
  assert out.count('finished earlier, reused') == 3 and 'resuming from step 2' in out
  assert eval_records(victim)[-1]['eval_loss'] == pytest.approx(before, rel=1e-6)
  assert kept.stat().st_mtime == kept_mtime
  assert again['points'][1]['runs'][1]['final_eval_loss'] == pytest.approx(before, rel=1e-6)

  # Interrupted before any checkpoint: it starts again from step 0, its earlier lines kept aside,
  # and the new metrics.jsonl holds one curve.
  shutil.rmtree(victim / 'checkpoints')
  (victim / 'done.json').unlink()
  sweep.run_sweep(config, axes, seeds=2, workdir=tmp_path, devices=ONE)
  assert 'no checkpoint to resume from' in capsys.readouterr().out
  assert len(list(victim.glob('metrics.interrupted-*.jsonl'))) == 1
  steps = [r['step'] for r in eval_records(victim)]
  assert steps == [2, 4] and eval_records(victim)[-1]['eval_loss'] == pytest.approx(before, rel=1e-6)


def test_bad_sweeps_are_refused_before_training(tmp_path):
  config = make_config(TINY_MQAR)
  with pytest.raises(runs.WorkflowError, match="unknown config key 'optimizer.lr'"):
    sweep.parse_axes(['optimizer.lr=1,2'], config)
  with pytest.raises(runs.WorkflowError, match='train.steps is of type int'):
    sweep.parse_axes(['train.steps=10,ten'], config)
  with pytest.raises(runs.WorkflowError, match='expected KEY=V1,V2'):
    sweep.parse_axes(['optimizer.name'], config)
  from kimijax.config import ConfigError

  with pytest.raises(ConfigError, match='optimizer.name'):
    sweep.plan(config, sweep.named(sweep.parse_axes(['optimizer.name=adamw,sgd'], config)), 1, tmp_path)
  assert not (tmp_path / 'runs').exists()


def test_run_folders_follow_run_pys_rule_on_a_changed_config(tmp_path):
  """One rule for run.py's resume and a workflow's run folder (kimijax.train.checkpoint.
  resume_differences): a longer train.steps, or any key outside the model and optimizer.name, is a
  notice; a different model is the error naming the key."""
  config = make_config(TINY_MQAR)
  (tmp_path / 'config.json').write_text(config.to_json())
  assert runs.check_folder(tmp_path, config) == []
  longer = make_config({**TINY_MQAR, 'train.steps': 8, 'train.log_every': 2})
  notices = runs.check_folder(tmp_path, longer)
  assert [n.split(' since')[0] for n in notices] == ['train.steps: 4 -> 8', 'train.log_every: 1 -> 2']
  assert 'the learning rate follows the new schedule' in notices[0]
  wider = make_config({**TINY_MQAR, 'model.d_model': 64})
  with pytest.raises(runs.WorkflowError, match=r'holds a run of another config \(model\.d_model: 32 -> 64\)'):
    runs.check_folder(tmp_path, wider)


@pytest.mark.long
def test_a_finished_run_continues_to_a_longer_train_steps(tmp_path, capsys):
  """A sweep's finished run whose train.steps grew is continued from its last checkpoint, as run.py
  continues it (it used to be refused as "a run of another config"); one whose train.steps shrank
  is reused as it finished."""
  run_dir = tmp_path / 'run'
  short = runs.train_run(make_config({**TINY_MQAR, 'train.steps': 2}), run_dir, devices=ONE)
  assert short['steps'] == 2
  capsys.readouterr()
  longer = runs.train_run(make_config({**TINY_MQAR, 'train.steps': 4}), run_dir, devices=ONE)
  out = capsys.readouterr().out
  assert f'{run_dir}: finished at step 2; continuing it to train.steps=4' in out
  assert 'resuming from step 2' in out and 'notice: train.steps: 2 -> 4 since the checkpoint' in out
  assert longer['steps'] == 4 and [s for s, _ in longer['curves']['train']] == [1, 2, 3, 4]
  assert json.loads((run_dir / 'done.json').read_text())['steps'] == 4
  again = runs.train_run(make_config({**TINY_MQAR, 'train.steps': 2}), run_dir, devices=ONE)
  out = capsys.readouterr().out
  assert 'finished earlier, reused' in out and 'notice: train.steps: 4 -> 2 since the run was saved' in out
  assert again['steps'] == 4 and again['final_eval_loss'] == longer['final_eval_loss']


@pytest.mark.long  # ~100 s: prepare, a sweep, eval and a generate subprocess
def test_sweep_eval_and_generate_on_bpe_shards_with_document_masking(tmp_path):
  """data.source='shards' through the workflows unchanged: shards prepared with a BPE trained here,
  the tokenizer's vocabulary taken by model.vocab_size=0, documents kept apart in a hybrid (KDA and
  attention); the sweep trains, reports epochs of the manifest's training tokens and the loss by
  position; --mode=eval and --mode=generate read the run's tokenizer."""
  import subprocess
  import sys

  from data_helpers import small_documents

  from kimijax.data import prepare
  from kimijax.data.shards import read_manifest
  from kimijax.train.evaluate import evaluate_run

  corpus = tmp_path / 'corpus.jsonl'
  corpus.write_text(''.join(json.dumps({'text': d}) + '\n' for d in small_documents(4)))
  shards = tmp_path / 'shards'
  prepare.prepare([str(corpus)], shards, train_tokenizer=600, workers=1, val_fraction=0.2, progress=False, log=print)
  overrides = {
    **TINY_MQAR,
    'data.source': 'shards',
    'data.path': str(shards),
    'data.tokenizer': f'hf:{shards}/tokenizer.json',
    'data.document_mask': True,
    'model.vocab_size': 0,
    'model.layer_pattern': 'KA',
    'model.num_layers': 2,
    'train.steps': 2,
  }
  config = make_config(overrides)
  axes = sweep.parse_axes(['optimizer.learning_rate=3e-3'], config)
  data = sweep.run_sweep(config, axes, seeds=1, workdir=tmp_path / 'sweep', devices=ONE)
  (run,) = data['points'][0]['runs']
  train_tokens = read_manifest(shards)['splits']['train']['tokens']
  assert run['epochs'] == pytest.approx(2 * 4 * 32 / train_tokens)
  assert run['loss_by_position']['loss'] and all(x > 0 for x in run['loss_by_position']['loss'])
  run_dir = tmp_path / 'sweep' / 'runs' / 'learning_rate=0.003,seed=0'
  stored = json.loads((run_dir / 'config.json').read_text())
  assert stored['model']['vocab_size'] == 640 and stored['data']['document_mask'] is True
  assert evaluate_run(run_dir, 1)['eval_loss'] == pytest.approx(run['final_eval_loss'], rel=1e-4)

  env = cpu_subprocess_env()
  generated = subprocess.run(
    [sys.executable, 'run.py', '--mode=generate', f'--workdir={run_dir}', '--prompt=def ', '--max_new_tokens=6'],
    capture_output=True,
    text=True,
    env=env,
    cwd=str(pathlib.Path(__file__).resolve().parents[2]),
  )
  assert generated.returncode == 0, generated.stderr[-2000:]
  assert generated.stdout.startswith('def ')
  # The last line: the prefill time and the decode loop's tokens/s (or, every row stopped at once, no step).
  assert re.fullmatch(r'prefill [\d.]+ ms \(1 x \d+ tokens\); decode .*', generated.stdout.splitlines()[-1])
