"""kimijax/train/loop.py end to end on a tiny model (CPU).

Through run.py: non-finite stop, initial loss, the metrics.jsonl schema and lr schedule (checked
against closed forms written here), output files. What a researcher sees across a run's life
(in-process train()): step 1 logged, the loss plot's title, --mode=eval's loss, a re-run of a
finished run writing nothing, a resume under a longer train.steps (a notice; TensorBoard purges the
replayed steps), a resume under another optimizer (an error naming optimizer.name), and loaders
that never create checkpoints/. The eval's accuracy and loss-by-position sums against a float64
NumPy transcription of the same logits, and the loop's power-of-two position buckets."""

import json
import math
import os
import pathlib
import re
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import cpu_subprocess_env
from tiny_config import TINY, make_config

from kimijax.model import Transformer
from kimijax.train import checkpoint as ckpt_lib, loop as loop_lib
from kimijax.train.checkpoint import CheckpointError
from kimijax.train.loop import NonFiniteError, evaluate_details, position_buckets, train
from kimijax.train.metrics import read_metrics as read_metrics_lib
from kimijax.train.step import make_eval_step

ROOT = pathlib.Path(__file__).resolve().parents[2]


def read_metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def run_py(workdir, flags, **kwargs):
  env = cpu_subprocess_env()
  command = [
    sys.executable,
    str(ROOT / 'run.py'),
    '--config=' + str(ROOT / 'configs/default.py'),
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in flags.items()]
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


# ------------------------------------------------------------------- (a) NaN / Inf stops


def test_nonfinite_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path):
  # Adam moves every weight by ~lr per step: with lr 1e6 and no clipping the logits overflow
  # float32 within a few steps.
  config = make_config(
    {
      **TINY,
      'optimizer.learning_rate': 1e6,
      'train.grad_clip': 0.0,
      'optimizer.warmup_steps': 0,
      'train.steps': 30,
      'train.checkpoint_every': 1,
      'train.eval_every': 1000,
    }
  )
  with pytest.raises(NonFiniteError) as info:
    train(config, tmp_path, devices=jax.devices()[:1])
  match = re.search(r'step (\d+)', str(info.value))
  assert match, str(info.value)
  bad = int(match.group(1))
  assert 1 < bad < 30

  logged = [r for r in read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in logged] == list(range(1, bad))  # nothing logged from step `bad` on
  assert all(math.isfinite(r['loss']) and math.isfinite(r['grad_norm']) for r in logged)

  steps = sorted(int(n) for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit())
  assert steps and steps[-1] == bad - 1  # the last good step, nothing later
  assert f'step {bad - 1}' in str(info.value)  # ... and the message says which
  with ocp.StandardCheckpointer() as reader:
    saved = reader.restore((tmp_path / 'checkpoints' / str(bad - 1) / 'state').absolute())
  leaves = jax.tree.leaves(saved['params'])
  assert leaves
  for leaf in jax.tree.leaves(saved):
    assert np.all(np.isfinite(np.asarray(leaf)))


# ------------------------------------------------- (b, c, d) one run.py run: metrics and files


METRICS_RUN = {
  **TINY,
  'model.init_std': 0.002,
  'train.steps': 6,
  'train.eval_every': 3,
  'train.checkpoint_every': 3,
  'train.plot': True,
  'optimizer.schedule': 'cosine',
  'optimizer.warmup_steps': 2,
  'optimizer.learning_rate': 3e-3,
  'optimizer.min_lr_ratio': 0.1,
}


@pytest.fixture(scope='module')
def metrics_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('metrics_run')
  proc = run_py(workdir, METRICS_RUN)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert 'fresh start' in out
  return workdir


def test_first_loss_is_log_vocab_size(metrics_run):
  # With init_std 0.002 every logit is ~0 (the tied embedding gives the input token's own logit
  # about d_model * init_std^2 / init_std = 0.13), so the predicted distribution is uniform.
  first = read_metrics(metrics_run)[0]
  assert first['step'] == 1
  assert first['loss'] == pytest.approx(math.log(258), abs=0.05)  # ln 258 = 5.553


def expected_lr(step, peak, warmup, total, min_ratio):
  """The lr of update number `step` (1-based; the schedule counts updates from 0): linear
  warmup from 0, then cosine from peak down to min_ratio * peak at count `total`."""
  count = step - 1
  if count < warmup:
    return peak * count / warmup
  frac = min(count - warmup, total - warmup) / (total - warmup)
  return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def test_metrics_lines(metrics_run):
  records = read_metrics(metrics_run)
  train_lines = [r for r in records if 'loss' in r]
  eval_lines = [r for r in records if 'eval_loss' in r]
  steps, batch, seq = METRICS_RUN['train.steps'], METRICS_RUN['train.batch_size'], METRICS_RUN['train.seq_len']
  assert [r['step'] for r in train_lines] == list(range(1, steps + 1))
  assert [r['step'] for r in eval_lines] == [3, 6]
  layer_keys = [f'max_logit_layer_{i}' for i in range(METRICS_RUN['model.num_layers'])]
  for r in train_lines:
    for key in ['step', 'loss', 'lr', 'tokens', 'tokens_per_sec', 'max_logit'] + layer_keys:
      assert key in r and math.isfinite(r[key]), (key, r)
    assert r['tokens'] == r['step'] * batch * seq
    assert r['tokens_per_sec'] >= 0
    assert r['max_logit'] == max(r[k] for k in layer_keys)
    want = expected_lr(r['step'], 3e-3, 2, steps, 0.1)
    assert r['lr'] == pytest.approx(want, rel=1e-5, abs=1e-9), r['step']
  assert all(r['tokens_per_sec'] > 0 for r in train_lines[1:])  # the first step includes compiling
  assert [r['lr'] for r in train_lines[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])  # warmup, then peak
  for r in eval_lines:
    assert math.isfinite(r['eval_loss']) and 0 < r['eval_loss'] < 6
    assert r['tokens'] == r['step'] * batch * seq
  assert train_lines[-1]['loss'] < train_lines[0]['loss']


def test_loss_plot_and_tensorboard_events(metrics_run):
  png = metrics_run / 'loss.png'
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 1000
  events = list((metrics_run / 'tensorboard').glob('events.out.tfevents.*'))
  assert events
  data = b''.join(p.read_bytes() for p in events)
  for tag in (b'loss', b'eval_loss', b'lr', b'max_logit'):
    assert tag in data


# ------------------------------------------------------------------- a run's life, in-process train()


RUN = {
  **TINY,
  'train.steps': 3,
  'train.log_every': 10,
  'train.eval_every': 10,
  'train.checkpoint_every': 1,
  'train.plot': True,
}


def _train(config, workdir):
  return loop_lib.train(config, workdir, devices=jax.devices()[:1])


def _event_records(path: pathlib.Path):
  """The Event protos of one TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2

  data, events, offset = path.read_bytes(), [], 0
  while offset < len(data):
    (length,) = struct.unpack('<Q', data[offset : offset + 8])
    event = event_pb2.Event()
    event.ParseFromString(data[offset + 12 : offset + 12 + length])
    events.append(event)
    offset += 12 + length + 4
  return events


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run')
  titles = []
  original = loop_lib.metrics_lib.plot_loss_curve
  loop_lib.metrics_lib.plot_loss_curve = lambda w, title=None: titles.append(title) or original(w, title)
  try:
    summary = _train(make_config(RUN), workdir)
  finally:
    loop_lib.metrics_lib.plot_loss_curve = original
  return workdir, summary, titles


def test_step_one_is_logged(finished_run):
  workdir, _, _ = finished_run
  assert [r['step'] for r in read_metrics_lib(workdir) if 'loss' in r] == [1, 3]  # log_every 10: 1 and the last


def test_loss_plot_title_names_run_params_tokens(finished_run):
  workdir, summary, titles = finished_run
  assert titles == [f'{workdir.name}: {summary["params"] / 1e6:.2f}M parameters, {summary["tokens"]:,} tokens']


def test_eval_mode_reproduces_the_final_eval_loss(finished_run):
  from kimijax.train.evaluate import evaluate_run

  workdir, summary, _ = finished_run
  result = evaluate_run(workdir)
  assert result['step'] == 3
  assert result['eval_loss'] == pytest.approx(summary['eval_loss'], rel=1e-5)
  logged = [json.loads(l) for l in (workdir / 'eval.jsonl').read_text().splitlines()]
  assert logged[-1]['eval_loss'] == result['eval_loss'] and logged[-1]['step'] == 3


def test_eval_at_a_longer_context_with_yarn_restores_the_run_and_reports_each_position(finished_run, tmp_path):
  """configs/trained.py:DIR with a longer context and YaRN: the run's checkpoint (YaRN may differ
  from training, other model keys may not), the loss of every position bucket up to the new
  length, logged to eval.jsonl."""
  import shutil

  from kimijax.config import load
  from kimijax.train.evaluate import evaluate_run

  workdir = shutil.copytree(finished_run[0], tmp_path / 'run')  # evaluate_run appends to DIR/eval.jsonl
  trained = load(f'configs/trained.py:{workdir}')
  longer = {'train.seq_len': 4 * trained.train.seq_len, 'model.yarn.original_context': trained.train.seq_len}
  plain = evaluate_run(workdir, 1, load(f'configs/trained.py:{workdir}', overrides=longer))
  yarn = evaluate_run(workdir, 1, load(f'configs/trained.py:{workdir}', overrides={**longer, 'model.yarn.factor': 4.0}))
  assert plain['step'] == yarn['step'] == 3 and yarn['seq_len'] == 4 * trained.train.seq_len
  assert yarn['position_buckets'] == [list(b) for b in position_buckets(4 * trained.train.seq_len)]
  assert all(loss is not None for loss in yarn['loss_by_position']) and yarn['eval_loss'] != plain['eval_loss']
  logged = [json.loads(line) for line in (workdir / 'eval.jsonl').read_text().splitlines()]
  assert [r['yarn_factor'] for r in logged[-2:]] == [0.0, 4.0]
  with pytest.raises(CheckpointError, match=r'model\.d_model'):
    evaluate_run(workdir, 1, load(f'configs/trained.py:{workdir}', overrides={'model.d_model': 32}))


def test_run_py_evaluates_and_generates_from_a_trained_run_with_keys_changed(finished_run, tmp_path):
  import shutil

  workdir = shutil.copytree(finished_run[0], tmp_path / 'run')
  common = [sys.executable, str(ROOT / 'run.py'), f'--config=configs/trained.py:{workdir}', f'--workdir={workdir}']
  common += ['--config.train.seq_len=128', '--config.model.yarn.factor=2', '--config.model.yarn.original_context=64']
  run = lambda *argv: subprocess.run(
    [*common, *argv], cwd=ROOT, env=cpu_subprocess_env(), capture_output=True, text=True
  )
  proc = run('--mode=eval')
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert re.search(r'by context length \(tokens\): 1-1 [\d.]+, .*, 64-128 [\d.]+$', proc.stdout.strip()), proc.stdout
  proc = run('--mode=generate', '--prompt=def ', '--max_new_tokens=8', '--temperature=0')
  assert proc.returncode == 0 and proc.stdout.startswith('def '), proc.stderr[-2000:]


def _run_py_eval(workdir, *argv):
  return subprocess.run(
    [sys.executable, str(ROOT / 'run.py'), '--mode=eval', f'--workdir={workdir}', '--compile_cache=', *argv],
    cwd=ROOT,
    env=cpu_subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_run_py_eval_that_cannot_fit_is_one_line_before_compiling(finished_run):
  """--mode=eval at a context whose eval step is past any host's memory (attention's [B, H, T, T]
  float32 logits at T = 2^20: tens of TB): one MemoryLimitError line naming train.batch_size and
  train.seq_len, before the checkpoint is read or the step compiled (it used to end in XLA's
  out-of-memory traceback), and no eval.jsonl line."""
  workdir = finished_run[0]
  log = workdir / 'eval.jsonl'
  logged = log.read_text() if log.exists() else None
  proc = _run_py_eval(workdir, f'--config=configs/trained.py:{workdir}', f'--config.train.seq_len={2**20}')
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr and len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith(f'MemoryLimitError: the eval step at train.batch_size=4 x train.seq_len={2**20} needs')
  assert 'lower train.seq_len or train.batch_size' in lines[0]
  assert (log.read_text() if log.exists() else None) == logged


def test_a_new_run_starts_from_another_runs_checkpoint_under_another_optimizer(finished_run, tmp_path):
  """train.init_from=DIR: the new run's parameters are DIR's latest checkpoint's, its optimizer
  state is Muon's fresh one (DIR trained with AdamW); eval and generate of the new run, before it
  saves a checkpoint, read DIR's weights; a model that differs is refused, naming the key."""
  from kimijax.optim import make_optimizer
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train.evaluate import evaluate_run
  from kimijax.train.step import build_training

  source = finished_run[0]
  config = make_config({**RUN, 'train.init_from': str(source), 'optimizer.name': 'muon'})
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  state = build_training(config, mesh, Transformer(config.model)).init_state(config)
  saved, _, _ = ckpt_lib.restore_latest_weights(source, make_config(RUN), Transformer(make_config(RUN).model), mesh)
  jax.tree.map(np.testing.assert_array_equal, state.params, saved)
  jax.tree.map(np.testing.assert_array_equal, state.opt_state, make_optimizer(config).init(state.params))
  assert int(state.step) == 0
  fresh = evaluate_run(tmp_path / 'new', 1, config)
  assert fresh['step'] == 0 and fresh['eval_loss'] == pytest.approx(finished_run[1]['eval_loss'], rel=1e-5)
  wider = make_config({**RUN, 'train.init_from': str(source), 'model.mlp_dim': 256})
  with pytest.raises(CheckpointError, match=r'model\.mlp_dim: 128 -> 256'):
    build_training(wider, mesh, Transformer(wider.model)).init_state(wider)


def test_rerun_of_a_finished_run_writes_nothing(finished_run):
  workdir, summary, _ = finished_run
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  again = _train(make_config(RUN), workdir)
  assert again['already_finished'] and again['steps'] == 3
  assert again['final_loss'] == pytest.approx(summary['final_loss'])
  assert again['eval_loss'] == pytest.approx(summary['eval_loss'])
  after = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  assert after == before


def test_rerun_of_a_finished_run_under_another_model_is_refused_as_a_resume_is(finished_run):
  """A finished run re-run with a model key changed: the resume's error naming the key (not
  'already finished'), word for word what an unfinished run's resume says, and nothing written; a
  key that may differ on resume (MAY_DIFFER: model.remat) still finds the run finished. Through
  run.py: one line on stderr, status 1, no traceback."""
  workdir, _, _ = finished_run
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  with pytest.raises(CheckpointError) as finished:
    _train(make_config({**RUN, 'model.mlp_dim': 256}), workdir)
  with pytest.raises(CheckpointError) as unfinished:
    _train(make_config({**RUN, 'model.mlp_dim': 256, 'train.steps': 5}), workdir)
  assert str(finished.value) == str(unfinished.value)
  assert str(finished.value).endswith('Differences (saved -> now): model.mlp_dim: 128 -> 256')
  assert _train(make_config({**RUN, 'model.remat': True}), workdir)['already_finished']
  after = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  assert after == before

  proc = run_py(workdir, {**RUN, 'model.mlp_dim': 256}, cwd=ROOT)
  _, stderr = proc.communicate(timeout=300)
  assert proc.returncode == 1 and 'Traceback' not in stderr, stderr[-2000:]
  assert stderr.strip().splitlines() == [f'CheckpointError: {finished.value}'], stderr[-2000:]


def test_resume_under_another_optimizer_names_the_key(finished_run, tmp_path):
  workdir, _, _ = finished_run
  config = make_config({**RUN, 'train.steps': 5, 'optimizer.name': 'muon'})
  with pytest.raises(CheckpointError, match=r"optimizer\.name: 'adamw' -> 'muon'"):
    _train(config, workdir)


def test_longer_resume_says_so_and_purges_replayed_tensorboard_steps(finished_run, capsys):
  workdir, _, _ = finished_run
  from tensorboardX import SummaryWriter

  # As if an interrupted run had logged step 4. Event files are named by the second they are
  # opened in and read in name order: the wait puts the resumed run's file after this one.
  with SummaryWriter(str(workdir / 'tensorboard'), filename_suffix='.interrupted') as stale:
    stale.add_scalar('loss', 99.0, 4)
  time.sleep(1.1)
  before = set((workdir / 'tensorboard').iterdir())
  _train(make_config({**RUN, 'train.steps': 4}), workdir)
  out = capsys.readouterr().out
  assert 'notice: train.steps: 3 -> 4 since the checkpoint' in out
  assert re.search(r'data: stdlib .*\n  train +[\d,]+ files +[\d,]+ bytes\n  validation +[\d,]+ files', out)
  new = sorted(set((workdir / 'tensorboard').iterdir()) - before)
  assert len(new) == 1
  starts = [e.step for e in _event_records(new[0]) if e.HasField('session_log')]
  assert starts == [4]  # TensorBoard drops earlier files' events from step 4 on
  # ... and TensorBoard's own reader (requirements.txt installs it) sees each step once.
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(workdir / 'tensorboard'))
  events.Reload()
  losses = events.Scalars('loss')
  assert [e.step for e in losses] == [1, 3, 4] and losses[-1].value != 99.0


def test_loading_a_run_without_checkpoints_creates_nothing(tmp_path):
  config = make_config(RUN)
  (tmp_path / 'config.json').write_text(config.to_json())
  from kimijax.infer.generate import load_for_generation

  with pytest.raises(CheckpointError, match='no checkpoint in'):
    load_for_generation(tmp_path)
  assert not (tmp_path / 'checkpoints').exists()


def test_schedule_changes_lists_each_changed_key():
  saved = json.loads(make_config(RUN).to_json())
  now = make_config({**RUN, 'train.steps': 9, 'optimizer.schedule': 'wsd'})
  lines = ckpt_lib.schedule_changes(saved, now)
  assert [l.split(' since')[0] for l in lines] == ['train.steps: 3 -> 9', "optimizer.schedule: 'cosine' -> 'wsd'"]


@pytest.mark.long  # ~50 s: two Muon runs
def test_muon_routing_is_one_line_and_a_file_and_a_resumed_summary_counts_this_run(tmp_path, capsys):
  """Muon's routing table goes to DIR/optimizer_routing.txt and the terminal gets one line (the table
  with train.print_routing=True); the summary after a resume gives this run's steps and tokens
  beside the run's total (it used to divide all tokens by this run's seconds)."""
  base = {
    **TINY,
    'train.steps': 2,
    'train.eval_every': 10,
    'train.checkpoint_every': 1,
    'train.plot': False,
    'optimizer.name': 'muon',
    'data.source': 'mqar',
    'data.mqar_num_pairs': 4,
  }
  _train(make_config(base), tmp_path)
  out = capsys.readouterr().out
  routing = tmp_path / 'optimizer_routing.txt'
  table = routing.read_text().rstrip('\n')
  assert table.splitlines()[0].split() == ['parameter', 'shape', 'rule', 'matrix', 'view', 'why']
  line = re.search(
    r'optimizer muon: adamw on ([\d,]+) parameters \((\d+) arrays\), muon on ([\d,]+) parameters \((\d+) arrays\); '
    rf'each parameter: {re.escape(str(routing))} \(train\.print_routing=True prints it\)',
    out,
  )
  assert line, out[-2000:]
  totals = re.fullmatch(r'muon: ([\d,]+) parameters, adamw: ([\d,]+) parameters', table.splitlines()[-1])
  assert (line.group(3), line.group(1)) == totals.groups()
  rows = table.splitlines()[2:-1]
  assert int(line.group(2)) + int(line.group(4)) == len(rows)
  assert table.splitlines()[0] not in out

  summary = _train(make_config({**base, 'train.steps': 3, 'train.print_routing': True}), tmp_path)
  out = capsys.readouterr().out
  assert table in out
  tokens = 4 * 64
  assert (summary['start_step'], summary['run_tokens'], summary['tokens']) == (2, tokens, 3 * tokens)
  text = loop_lib.summary_text(summary)
  rate = tokens / summary['seconds']
  assert f'this run     steps 3-3: {tokens:,} tokens in {summary["seconds"]:.0f} s, {rate:,.0f} tokens/s' in text
  assert f'in all       3 steps, {3 * tokens:,} tokens (resumed from step 2)' in text


# ------------------------------------------------------------------- eval details


def test_position_buckets_double_and_cover_every_position_once():
  assert position_buckets(16) == [(0, 0), (1, 2), (3, 6), (7, 15)]  # 1, 2-3, 4-7, 8-16 tokens seen
  for t in (1, 5, 64, 100, 4096):
    buckets = position_buckets(t)
    assert buckets[0][0] == 0 and buckets[-1][1] == t - 1
    assert all(b[0] == a[1] + 1 for a, b in zip(buckets, buckets[1:]))


def test_eval_sums_match_numpy_per_position_and_accuracy():
  config = make_config({**TINY, 'train.seq_len': 16})
  model = Transformer(config.model)
  rng = np.random.default_rng(0)
  batches = [
    {
      'inputs': rng.integers(0, 256, (3, 16)).astype(np.int32),
      'targets': rng.integers(0, 256, (3, 16)).astype(np.int32),
      'mask': (rng.random((3, 16)) < 0.7).astype(np.float32),
    }
    for _ in range(2)
  ]
  params = model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))['params']
  details = evaluate_details(jax.jit(make_eval_step(model)), params, batches)

  nll = np.zeros(16)
  count = np.zeros(16)
  hits = 0.0
  for b in batches:
    logits = np.asarray(model.apply({'params': params}, b['inputs'])[0], np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    tok = -np.take_along_axis(logp, b['targets'][..., None], -1)[..., 0]
    nll += (tok * b['mask']).sum(0)
    count += b['mask'].sum(0)
    hits += ((logits.argmax(-1) == b['targets']) * b['mask']).sum()
  assert details['eval_loss'] == pytest.approx(nll.sum() / count.sum(), rel=1e-5)
  assert details['accuracy'] == pytest.approx(hits / count.sum(), abs=1e-7)
  assert details['position_buckets'] == [[0, 0], [1, 2], [3, 6], [7, 15]]
  for (first, last), loss in zip(details['position_buckets'], details['loss_by_position']):
    sl = slice(first, last + 1)
    if count[sl].sum():
      assert loss == pytest.approx(nll[sl].sum() / count[sl].sum(), rel=1e-5)
    else:
      assert loss is None
