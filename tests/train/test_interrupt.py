"""Ctrl-C (SIGINT) during training through run.py: the step finishes, a save in progress
completes, the run exits 130 naming the step reached and the last complete checkpoint, and the
workdir lock is released."""

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

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
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
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
