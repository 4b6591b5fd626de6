"""The training loop end to end on a tiny model (CPU): non-finite stop, initial loss, the
metrics.jsonl schema and lr schedule (checked against closed forms written here), output files,
and config errors caught before any training."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from kimijax.config import ConfigError, base_config, validate
from kimijax.train.loop import NonFiniteError, train

from tiny_config import TINY, make_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def read_metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def run_py(workdir, flags, **kwargs):
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}   # one CPU device, not 8 fake
  env['JAX_PLATFORMS'] = 'cpu'
  command = [sys.executable, str(ROOT / 'run.py'), '--config=' + str(ROOT / 'configs/default.py'),
             f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in flags.items()]
  return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs)


# ------------------------------------------------------------------- (a) NaN / Inf stops


def test_nonfinite_loss_stops_with_step_and_keeps_last_good_checkpoint(tmp_path):
  # Adam moves every weight by ~lr per step: with lr 1e6 and no clipping the logits overflow
  # float32 within a few steps.
  config = make_config({**TINY, 'optimizer.learning_rate': 1e6, 'train.grad_clip': 0.0,
                        'optimizer.warmup_steps': 0, 'train.steps': 30, 'train.checkpoint_every': 1,
                        'train.eval_every': 1000})
  with pytest.raises(NonFiniteError) as info:
    train(config, tmp_path, devices=jax.devices()[:1])
  match = re.search(r'step (\d+)', str(info.value))
  assert match, str(info.value)
  bad = int(match.group(1))
  assert 1 < bad < 30

  logged = [r for r in read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in logged] == list(range(1, bad))       # nothing logged from step `bad` on
  assert all(math.isfinite(r['loss']) and math.isfinite(r['grad_norm']) for r in logged)

  steps = sorted(int(n) for n in os.listdir(tmp_path / 'checkpoints') if n.isdigit())
  assert steps and steps[-1] == bad - 1                            # the last good step, nothing later
  assert f'step {bad - 1}' in str(info.value)                      # ... and the message says which
  with ocp.StandardCheckpointer() as reader:
    saved = reader.restore((tmp_path / 'checkpoints' / str(bad - 1) / 'state').absolute())
  leaves = jax.tree.leaves(saved['params'])
  assert leaves
  for leaf in jax.tree.leaves(saved):
    assert np.all(np.isfinite(np.asarray(leaf)))


# ------------------------------------------------- (b, c, d) one run.py run: metrics and files


METRICS_RUN = {**TINY, 'model.init_std': 0.002, 'train.steps': 6, 'train.eval_every': 3,
               'train.checkpoint_every': 3, 'train.plot': True, 'optimizer.schedule': 'cosine',
               'optimizer.warmup_steps': 2, 'optimizer.learning_rate': 3e-3,
               'optimizer.min_lr_ratio': 0.1}


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
  assert first['loss'] == pytest.approx(math.log(258), abs=0.05)   # ln 258 = 5.553


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
  assert all(r['tokens_per_sec'] > 0 for r in train_lines[1:])     # the first step includes compiling
  assert [r['lr'] for r in train_lines[:3]] == pytest.approx([0.0, 1.5e-3, 3e-3])   # warmup, then peak
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


# ------------------------------------------------------------------------ (e) config errors


BAD = [  # (override, fragments the one message must contain)
    ({'model.foo': 1}, ['model.foo', "'d_model'", "'num_heads'"]),
    ({'model.d_model': -64}, ['model.d_model', 'positive']),
    ({'model.num_heads': 3}, ['model.num_heads', 'model.d_model']),
    ({'optimizer.name': 'sgd'}, ['optimizer.name', "'adamw'"]),
    ({'model.layer_pattern': 'AX'}, ['model.layer_pattern', "'X'", "'A'"]),
]
BAD_IDS = ['unknown_key', 'negative_d_model', 'heads_not_dividing', 'unknown_optimizer', 'unknown_layer_letter']


@pytest.mark.parametrize('override,fragments', BAD, ids=BAD_IDS)
def test_validate_rejects_bad_config(override, fragments):
  c = base_config()
  for key, value in override.items():
    group, name = key.split('.')
    c[group][name] = value                   # an unlocked ConfigDict accepts new keys
  with pytest.raises(ConfigError) as info:
    validate(c)
  for fragment in fragments:
    assert fragment in str(info.value), str(info.value)


def test_run_py_rejects_bad_config_before_training(tmp_path):
  procs = [(override, fragments, tmp_path / name, run_py(tmp_path / name, {**TINY, **override}))
           for (override, fragments), name in zip(BAD, BAD_IDS)]   # all at once: each only starts up
  for override, fragments, workdir, proc in procs:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0, override
    assert 'Traceback' not in err, err[-2000:]
    lines = [l for l in err.splitlines() if 'ConfigError' in l]
    assert len(lines) == 1, err[-2000:]                             # one message
    for fragment in fragments:
      assert fragment in lines[0], (override, lines[0])
    assert not (workdir / 'checkpoints').exists() and not (workdir / 'metrics.jsonl').exists()
