"""What a researcher sees across a run's life (in-process train()): step 1 logged, the loss
plot's title, --mode=eval's loss, a re-run of a finished run writing nothing, a resume under a
longer train.steps (a notice; TensorBoard purges the replayed steps), a resume under another
optimizer (an error naming optimizer.name), and loaders that never create checkpoints/."""

import json
import pathlib
import re
import struct
import time

import jax
import pytest

from tiny_config import TINY, make_config
from kimijax.train import checkpoint as ckpt_lib
from kimijax.train import loop as loop_lib
from kimijax.train.checkpoint import CheckpointError
from kimijax.train.metrics import read_metrics

RUN = {**TINY, 'train.steps': 3, 'train.log_every': 10, 'train.eval_every': 10, 'train.checkpoint_every': 1,
       'train.plot': True}


def _train(config, workdir):
  return loop_lib.train(config, workdir, devices=jax.devices()[:1])


def _event_records(path: pathlib.Path):
  """The Event protos of one TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
  from tensorboardX.proto import event_pb2
  data, events, offset = path.read_bytes(), [], 0
  while offset < len(data):
    (length,) = struct.unpack('<Q', data[offset:offset + 8])
    event = event_pb2.Event()
    event.ParseFromString(data[offset + 12: offset + 12 + length])
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
  assert [r['step'] for r in read_metrics(workdir) if 'loss' in r] == [1, 3]   # log_every 10: 1 and the last


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


def test_rerun_of_a_finished_run_writes_nothing(finished_run):
  workdir, summary, _ = finished_run
  before = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  again = _train(make_config(RUN), workdir)
  assert again['already_finished'] and again['steps'] == 3
  assert again['final_loss'] == pytest.approx(summary['final_loss'])
  assert again['eval_loss'] == pytest.approx(summary['eval_loss'])
  after = {p: p.stat().st_mtime_ns for p in workdir.rglob('*') if p.is_file() and p.name != 'eval.jsonl'}
  assert after == before


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
  assert starts == [4]          # TensorBoard drops earlier files' events from step 4 on
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
  assert [l.split(' since')[0] for l in lines] == ["train.steps: 3 -> 9", "optimizer.schedule: 'cosine' -> 'wsd'"]
