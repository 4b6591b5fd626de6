"""Checkpointing: exact resume, SIGKILL mid-save, restore onto another mesh, corrupt/mismatched
checkpoints. Tiny model (d_model 64, 2 layers) on CPU; every reference is a separate
uninterrupted run of the same config, never the code path under test."""

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import CACHE_OPTIONS, cpu_subprocess_env, persistent_compile_cache
from tiny_config import TINY, make_config

from kimijax import config as config_lib
from kimijax.train.checkpoint import CheckpointError
from kimijax.train.loop import train

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Constant lr after warmup: a cosine schedule is a function of train.steps, so a 4-step run
# extended to 8 would (by design) follow a different lr curve than a straight 8-step run.
RESUMABLE = {
  **TINY,
  'optimizer.schedule': 'constant',
  'optimizer.warmup_steps': 2,
  'train.steps': 8,
  'train.eval_every': 4,
  'train.checkpoint_every': 4,
}


def run_train(overrides, workdir, num_devices=1):
  return train(make_config(overrides), workdir, devices=jax.devices()[:num_devices])


def read_metrics(workdir):
  return [json.loads(l) for l in (pathlib.Path(workdir) / 'metrics.jsonl').read_text().splitlines()]


def train_losses(workdir):
  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}


def assert_continuous(workdir, last_step):
  """One train line per step 1..last_step (no duplicates, no gaps), eval steps unique."""
  records = read_metrics(workdir)
  assert [r['step'] for r in records if 'loss' in r] == list(range(1, last_step + 1))
  eval_steps = [r['step'] for r in records if 'eval_loss' in r]
  assert len(eval_steps) == len(set(eval_steps)) and eval_steps == sorted(eval_steps)


def saved_arrays(workdir, step):
  """{leaf path: numpy array} read straight from checkpoints/<step>/state."""
  with ocp.StandardCheckpointer() as reader:
    tree = reader.restore(pathlib.Path(workdir).absolute() / 'checkpoints' / str(step) / 'state')
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def digest(folder):
  """sha256 over the relative names and bytes of every file and folder below `folder`."""
  h = hashlib.sha256()
  for p in sorted(pathlib.Path(folder).rglob('*')):
    h.update(str(p.relative_to(folder)).encode() + b'\0')
    if p.is_file():
      h.update(p.read_bytes())
  return h.hexdigest()


def complete_steps(ckpt_dir):
  """Checkpoint steps orbax has finalised (renamed from its temporary folder)."""
  return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()) if ckpt_dir.exists() else []


@pytest.fixture(scope='module', autouse=True)
def compile_cache(tmp_path_factory):
  """A persistent XLA cache for this module only (helpers.persistent_compile_cache): each train()
  call jits afresh, and on 2 CPU cores compiling dominates these tests."""
  with persistent_compile_cache(tmp_path_factory.mktemp('xla_cache')) as directory:
    yield directory


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """A straight, uninterrupted 8-step run on one device."""
  workdir = tmp_path_factory.mktemp('reference')
  run_train(RESUMABLE, workdir)
  return workdir


@pytest.fixture(scope='module')
def first_half(tmp_path_factory):
  """The same config stopped after 4 steps (train.steps=4), checkpointed at step 4."""
  workdir = tmp_path_factory.mktemp('first_half')
  run_train({**RESUMABLE, 'train.steps': 4}, workdir)
  assert complete_steps(workdir / 'checkpoints') == [4]
  assert [r['step'] for r in read_metrics(workdir) if 'loss' in r] == [1, 2, 3, 4]
  return workdir


# ------------------------------------------------------------------------ 1. exact resume


def test_resume_reproduces_uninterrupted_run(reference, first_half, tmp_path, capsys):
  shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)
  capsys.readouterr()
  run_train(RESUMABLE, tmp_path)  # the same command, now to 8 steps
  assert 'resuming from step 4' in capsys.readouterr().out

  assert_continuous(tmp_path, 8)
  assert_continuous(reference, 8)
  got, want = train_losses(tmp_path), train_losses(reference)
  for step in range(1, 9):
    assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
  got_eval = {r['step']: r['eval_loss'] for r in read_metrics(tmp_path) if 'eval_loss' in r}
  want_eval = {r['step']: r['eval_loss'] for r in read_metrics(reference) if 'eval_loss' in r}
  assert got_eval.keys() == want_eval.keys() == {4, 8}
  for step in want_eval:
    assert got_eval[step] == pytest.approx(want_eval[step], rel=1e-6, abs=0)

  got_state, want_state = saved_arrays(tmp_path, 8), saved_arrays(reference, 8)
  assert got_state.keys() == want_state.keys()
  assert any('params' in k for k in got_state)
  for key in want_state:  # params, optimizer moments and step counter
    np.testing.assert_allclose(got_state[key], want_state[key], rtol=1e-6, atol=0, err_msg=key)


# ------------------------------------------------------------------ 2. SIGKILL mid-save


KILL_FLAGS = {
  **TINY,
  'train.steps': 24,
  'train.checkpoint_every': 1,
  'train.keep_checkpoints': 3,
  'train.eval_every': 1000,
  'optimizer.warmup_steps': 5,
}


def run_py_command(workdir, flags):
  return [
    sys.executable,
    str(ROOT / 'run.py'),
    '--config=' + str(ROOT / 'configs/default.py'),
    f'--workdir={workdir}',
  ] + [f'--config.{k}={v}' for k, v in flags.items()]


def subprocess_env(cache_dir):
  env = cpu_subprocess_env()
  env.update({name.upper(): str(value) for name, value in CACHE_OPTIONS.items()})
  env['JAX_COMPILATION_CACHE_DIR'] = cache_dir
  return env


@pytest.mark.long
def test_sigkill_mid_save_resumes_from_last_complete_checkpoint(tmp_path, compile_cache):
  env, ckpt = subprocess_env(compile_cache), tmp_path / 'run' / 'checkpoints'
  command = run_py_command(tmp_path / 'run', KILL_FLAGS)
  proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  killed_mid_save = False
  deadline = time.time() + 120
  try:
    while proc.poll() is None and time.time() < deadline:
      names = os.listdir(ckpt) if ckpt.exists() else []
      done = [int(n) for n in names if n.isdigit()]
      in_flight = any('orbax-checkpoint-tmp' in n for n in names)
      # Prefer to kill while orbax is writing a step (its temporary folder exists).
      if (len(done) >= 2 and in_flight) or (done and max(done) >= 8):
        proc.kill()
        killed_mid_save = in_flight
        break
      time.sleep(0.001)
  finally:
    proc.kill()
    proc.wait()
  assert proc.returncode == -9, 'run finished before it could be killed'
  k = max(complete_steps(ckpt))
  assert 2 <= k < KILL_FLAGS['train.steps']
  leftovers = [n for n in os.listdir(ckpt) if not n.isdigit()]
  print(f'killed after step {k}; mid-save: {killed_mid_save}; left in checkpoints/: {leftovers}')

  resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f'resuming from step {k}' in resumed.stdout

  straight = subprocess.run(
    run_py_command(tmp_path / 'straight', KILL_FLAGS), env=env, capture_output=True, text=True, timeout=300
  )
  assert straight.returncode == 0, straight.stderr[-3000:]
  assert 'fresh start' in straight.stdout

  steps = KILL_FLAGS['train.steps']
  assert_continuous(tmp_path / 'run', steps)
  got, want = train_losses(tmp_path / 'run'), train_losses(tmp_path / 'straight')
  for step in range(1, steps + 1):
    assert got[step] == pytest.approx(want[step], rel=1e-6, abs=0), step
  print('after resume, checkpoints/ holds', sorted(os.listdir(ckpt)))
  assert complete_steps(ckpt) == list(range(steps - 2, steps + 1))  # keep_checkpoints=3
  got_state, want_state = saved_arrays(tmp_path / 'run', steps), saved_arrays(tmp_path / 'straight', steps)
  for key in want_state:
    np.testing.assert_allclose(got_state[key], want_state[key], rtol=1e-6, atol=0, err_msg=key)


# ------------------------------------------------------------- 3. restore onto another mesh


def test_restore_onto_a_different_mesh(reference, first_half, tmp_path, capsys):
  shutil.copytree(first_half, tmp_path, dirs_exist_ok=True)  # trained on a 1-device mesh
  capsys.readouterr()
  sharded = {**RESUMABLE, 'mesh.data': 2, 'mesh.fsdp': 2}
  run_train(sharded, tmp_path, num_devices=4)
  out = capsys.readouterr().out
  assert 'resuming from step 4' in out and "'data': 2, 'fsdp': 2" in out

  assert_continuous(tmp_path, 8)
  got, want = train_losses(tmp_path), train_losses(reference)
  for step in range(1, 9):
    assert got[step] == pytest.approx(want[step], rel=1e-5), step
  got_state, want_state = saved_arrays(tmp_path, 8), saved_arrays(reference, 8)
  for key in want_state:
    if 'params' in key:
      np.testing.assert_allclose(got_state[key], want_state[key], rtol=1e-4, atol=1e-6, err_msg=key)


# ------------------------------------------------------- 4. corrupt or mismatched checkpoints


def largest_file(folder):
  return max((p for p in folder.rglob('*') if p.is_file()), key=lambda p: p.stat().st_size)


def truncate(path):
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])


def garble(path):
  """Flips 64 bytes in the middle: the file keeps its size and structure, the values change."""
  data = bytearray(path.read_bytes())
  mid = len(data) // 2
  data[mid : mid + 64] = bytes(b ^ 0xA5 for b in data[mid : mid + 64])
  path.write_bytes(bytes(data))


def expect_refusal(workdir, overrides, *fragments):
  """train() must raise CheckpointError naming `fragments`, and change nothing on disk."""
  before_ckpt, before_metrics = digest(workdir / 'checkpoints'), (workdir / 'metrics.jsonl').read_bytes()
  with pytest.raises(CheckpointError) as info:
    run_train(overrides, workdir)
  message = str(info.value)
  for fragment in fragments:
    assert fragment in message, message
  assert digest(workdir / 'checkpoints') == before_ckpt
  assert (workdir / 'metrics.jsonl').read_bytes() == before_metrics  # no step was taken
  return message


@pytest.mark.parametrize('damage', [truncate, garble])
def test_corrupt_checkpoint_stops_before_training(reference, tmp_path, damage):
  workdir = tmp_path / 'w'
  shutil.copytree(reference, workdir)
  latest = workdir / 'checkpoints' / '8'
  damage(largest_file(latest / 'state'))  # the array data of params and optimizer moments
  expect_refusal(workdir, {**RESUMABLE, 'train.steps': 12}, str(latest))


def test_mismatched_config_stops_before_training(reference, tmp_path):
  workdir = tmp_path / 'w'
  shutil.copytree(reference, workdir)
  message = expect_refusal(
    workdir, {**RESUMABLE, 'train.steps': 12, 'model.d_model': 32}, str(workdir / 'checkpoints' / '8'), 'model.d_model'
  )
  assert '64' in message and '32' in message


def test_weights_restore_reads_and_checks_params_not_the_optimizer_state(reference, tmp_path):
  """restore_latest_weights (eval, generation, train.init_from) gives the saved params bit for bit,
  refuses a params array whose saved checksum differs, and leaves the optimizer's moments out (it
  does not read them): a wrong checksum recorded for one of them stops a resume's full restore but
  not this one."""
  from kimijax.model import Transformer
  from kimijax.optim import make_optimizer
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train.checkpoint import Checkpointer, restore_latest_weights
  from kimijax.train.state import state_shardings

  config = make_config({**RESUMABLE})
  model, mesh = Transformer(config.model), mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  params, moe_state, step = restore_latest_weights(reference, config, model, mesh)
  assert step == 8 and moe_state == {}
  on_disk = saved_arrays(reference, 8)
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  assert len(leaves) == sum(k.startswith("['params']") for k in on_disk)
  for path, leaf in leaves:
    np.testing.assert_array_equal(np.asarray(leaf), on_disk["['params']" + jax.tree_util.keystr(path)])

  def with_wrong_checksum(prefix):
    workdir = tmp_path / prefix.strip('.')
    shutil.copytree(reference, workdir)
    meta = workdir / 'checkpoints' / '8' / 'checksums' / 'metadata'
    sums = json.loads(meta.read_text())
    key = next(k for k in sorted(sums) if k.startswith(prefix))
    sums[key] = [sums[key][0] ^ 1, sums[key][1]]
    meta.write_text(json.dumps(sums))
    return workdir, key

  workdir, key = with_wrong_checksum('.params')
  with pytest.raises(CheckpointError, match='is corrupt') as info:
    restore_latest_weights(workdir, config, model, mesh)
  assert key in str(info.value)

  workdir, key = with_wrong_checksum('.opt_state')
  restored, _, _ = restore_latest_weights(workdir, config, model, mesh)
  jax.tree.map(np.testing.assert_array_equal, restored, params)
  abstract, _ = state_shardings(model, make_optimizer(config), config, mesh)
  checkpointer = Checkpointer(workdir / 'checkpoints', keep=config.train.keep_checkpoints)
  with pytest.raises(CheckpointError, match='is corrupt'):
    checkpointer.restore(8, abstract, config)
  checkpointer.close()


# ------------------------------------------------------- 5. generation from a trained run


def test_a_gpu_run_evaluates_and_generates_on_the_cpu(reference, tmp_path):
  """run.py --mode=eval's and --mode=generate's loaders on a run trained with a GPU config's
  implementations (configs_common.gpu_kernels, cuDNN attention, Pallas AttnRes, tokamax's grouped
  matmul, remat), written both into config.json and into the checkpoint's own saved config: on the
  CPU both switch to the XLA implementations and restore the checkpoint (implementation keys need
  not match the saved config); the params are the saved arrays bit for bit, greedy generation gives
  what the run's own config gives, and so does the eval loss."""
  from kimijax.configs_common import gpu_kernels
  from kimijax.infer.generate import generate, load_for_generation
  from kimijax.train.evaluate import evaluate_run

  workdir = tmp_path / 'w'
  shutil.copytree(reference, workdir)
  gpu = config_lib.base_config().model
  gpu_kernels(gpu, attn_impl='cudnn')
  implementations = {k: gpu[k] for k in ('attn_impl', 'kda_impl', 'short_conv_impl', 'mla_decode_impl')}
  for path in (workdir / 'config.json', workdir / 'checkpoints' / '8' / 'config' / 'metadata'):
    saved = json.loads(path.read_text())
    saved['model'].update(implementations, attnres_impl='pallas', remat=True)
    saved['model']['moe'].update(impl='tokamax', remat=True)
    path.write_text(json.dumps(saved))

  config, model, params = load_for_generation(workdir)
  m = config.model
  impls = (m.attn_impl, m.kda_impl, m.short_conv_impl, m.attnres_impl, m.mla_decode_impl, m.moe.impl)
  assert impls == ('xla', 'xla', 'xla', 'xla', 'xla', 'xla_blocked') and m.remat and m.moe.remat
  on_disk = saved_arrays(workdir, 8)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    np.testing.assert_array_equal(np.asarray(leaf), on_disk["['params']" + jax.tree_util.keystr(path)])

  _, ref_model, ref_params = load_for_generation(reference)
  prompt = np.array([[5, 9, 2, 7]], np.int32)
  greedy = lambda m, p: generate(m, p, prompt, max_new_tokens=6, temperature=0.0)
  np.testing.assert_array_equal(greedy(model, params), greedy(ref_model, ref_params))

  copy = shutil.copytree(reference, tmp_path / 'reference')  # evaluate_run appends to DIR/eval.jsonl
  assert evaluate_run(workdir)['eval_loss'] == pytest.approx(evaluate_run(copy)['eval_loss'], rel=1e-6)
