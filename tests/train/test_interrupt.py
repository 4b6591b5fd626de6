"""Ctrl-C (SIGINT) during training through run.py: the step finishes, a save in progress
completes, the run exits 130 naming the step reached and the last complete checkpoint, and the
workdir lock is released."""

import json
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import cpu_subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAGS = [
  '--config.model.d_model=64',
  '--config.model.num_layers=2',
  '--config.model.num_heads=2',
  '--config.model.mlp_dim=128',
  '--config.train.seq_len=64',
  '--config.train.batch_size=4',
  '--config.train.eval_batches=1',
  '--config.train.plot=False',
  '--config.train.log_every=1',
  '--config.train.steps=400',
  '--config.train.checkpoint_every=1',
  '--config.train.eval_every=1000',
]


@pytest.mark.slow
def test_sigint_exits_130_with_step_and_last_checkpoint(tmp_path):
  env = cpu_subprocess_env()
  command = [sys.executable, str(ROOT / 'run.py'), '--config=configs/default.py', f'--workdir={tmp_path}'] + FLAGS
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  metrics = tmp_path / 'metrics.jsonl'
  deadline = time.time() + 240
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:  # mid-run, saving every step
      break
    time.sleep(0.2)
  assert proc.poll() is None, proc.communicate()[1][-3000:]
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130, err[-3000:]
  assert 'Traceback' not in err and 'Fatal Python error' not in err, err[-3000:]
  match = re.search(r'interrupted at step (\d+); the last complete checkpoint is step (\d+) in (\S+)', err)
  assert match, err[-2000:]
  step, saved = int(match.group(1)), int(match.group(2))
  assert saved == step  # checkpoint_every=1: the save completed
  complete = sorted(int(p.name) for p in (tmp_path / 'checkpoints').iterdir() if p.name.isdigit())
  assert complete[-1] == saved
  assert not (tmp_path / 'run.lock').exists()
  logged = [json.loads(l)['step'] for l in metrics.read_text().splitlines()]
  assert logged == list(range(1, step + 1))


SIGTERM_STEPS = 60
SIGTERM_FLAGS = [
  f for f in FLAGS if not f.startswith(('--config.train.steps=', '--config.train.checkpoint_every='))
] + [
  f'--config.train.steps={SIGTERM_STEPS}',
  '--config.train.checkpoint_every=1000',  # no checkpoint but the one the signal asks for
]


def _run_py(workdir, flags=SIGTERM_FLAGS):
  env = cpu_subprocess_env()
  command = [sys.executable, str(ROOT / 'run.py'), '--config=configs/default.py', f'--workdir={workdir}'] + flags
  return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _losses(workdir) -> dict[int, float]:
  lines = [json.loads(l) for l in (workdir / 'metrics.jsonl').read_text().splitlines()]
  steps = [r['step'] for r in lines if 'loss' in r]
  assert steps == sorted(set(steps)), steps  # every logged step once
  return {r['step']: r['loss'] for r in lines if 'loss' in r}


@pytest.mark.slow
@pytest.mark.long
def test_sigterm_saves_the_current_step_and_resume_continues_the_uninterrupted_curve(tmp_path):
  """SIGTERM (a scheduler's preemption) mid-run: the step finishes, a checkpoint of it is saved
  although no checkpoint was due, the lock is released, the exit status is 143; re-running the
  command continues the loss curve of an uninterrupted run exactly, with no step lost or repeated."""
  stopped, reference = tmp_path / 'stopped', tmp_path / 'reference'
  proc, ref = _run_py(stopped), _run_py(reference)
  metrics = stopped / 'metrics.jsonl'
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
      break
    time.sleep(0.05)
  assert proc.poll() is None, proc.communicate()[1][-3000:]
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-3000:]
  assert 'Traceback' not in err, err[-3000:]
  assert 'SIGTERM: stopping after this step, with a checkpoint of it within 25 s' in err
  match = re.search(r'SIGTERM: interrupted at step (\d+); the last complete checkpoint is step (\d+) in (\S+)', err)
  assert match, err[-2000:]
  step = int(match.group(1))
  assert int(match.group(2)) == step and 3 <= step < SIGTERM_STEPS
  assert sorted(int(p.name) for p in (stopped / 'checkpoints').iterdir() if p.name.isdigit()) == [step]
  assert not (stopped / 'run.lock').exists()

  resumed = _run_py(stopped)
  out, err = resumed.communicate(timeout=300)
  assert resumed.returncode == 0, err[-3000:]
  assert f'resuming from step {step}' in out
  tokens = 4 * 64  # batch x seq_len
  assert f'this run     steps {step + 1}-{SIGTERM_STEPS}: {(SIGTERM_STEPS - step) * tokens:,} tokens in' in out
  assert f'in all       {SIGTERM_STEPS} steps, {SIGTERM_STEPS * tokens:,} tokens (resumed from step {step})' in out
  ref_out, ref_err = ref.communicate(timeout=300)
  assert ref.returncode == 0, ref_err[-3000:]
  got, want = _losses(stopped), _losses(reference)
  assert list(got) == list(want) == list(range(1, SIGTERM_STEPS + 1))
  for s in want:
    assert got[s] == pytest.approx(want[s], rel=1e-6, abs=0), s


GRACE_SCRIPT = """
import pathlib, sys, time
from kimijax.train.interrupt import StopOnInterrupt
from kimijax.train.lock import WorkdirLock
lock = WorkdirLock(sys.argv[1])
lock.acquire()
with StopOnInterrupt(grace_s=0.5, on_expiry=lock.release) as stop:
  print('ready', flush=True)
  while True:  # a step that never ends: the stop request is never honoured
    time.sleep(0.01)
"""


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGUSR1], ids=['SIGTERM', 'SIGUSR1'])
def test_a_stop_that_outlasts_the_grace_period_releases_the_lock_and_exits(tmp_path, signum):
  """train.preemption_grace_s bounds the stop: a step (and its save) still running grace_s after
  the signal ends the process with 128 + the signal, its workdir lock released, before a
  scheduler's SIGKILL would leave the lock behind."""
  proc = subprocess.Popen(
    [sys.executable, '-c', GRACE_SCRIPT, str(tmp_path)],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  assert proc.stdout.readline().strip() == 'ready', proc.communicate()[1][-2000:]
  assert (tmp_path / 'run.lock').exists()
  began = time.time()
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == 128 + signum, err
  assert time.time() - began < 30
  name = signal.Signals(signum).name
  assert f'{name}: stopping after this step' in err
  assert f'{name}: the step and its checkpoint did not finish within train.preemption_grace_s=0.5 s' in err
  assert not (tmp_path / 'run.lock').exists()
