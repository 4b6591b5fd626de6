"""Two processes training together through run.py log the same losses as one process.

Each process is a separate `run.py` with one CPU device, joined by jax.distributed (gloo
collectives, coordinator on 127.0.0.1): a 2-device data-parallel mesh where every process feeds
its half of the global batch. The reference is one `run.py` process on one device with the same
global batch. Both processes checkpoint into the same workdir; a second 2-process launch resumes
from that checkpoint and must continue the single-process loss curve, and the checkpoint restores
to the single-process parameters. A run may also change its process count on resume (two
processes, then one, then two again) and still follow the single-process curve.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from helpers import cpu_subprocess_env, eval_losses, run_py_args, tiny_run_overrides, train_losses

from kimijax import config as config_lib
from kimijax.model import Transformer
from kimijax.optim import make_optimizer
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.checkpoint import Checkpointer
from kimijax.train.metrics import read_metrics
from kimijax.train.state import state_shardings

REPO = pathlib.Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
RTOL = 1e-5
FIRST, TOTAL = 5, 7  # the 2-process run stops at FIRST, then resumes to TOTAL

OVERRIDES = tiny_run_overrides(FIRST)


def free_port() -> int:
  try:
    import portpicker

    return portpicker.pick_unused_port()
  except ImportError:
    import socket

    with socket.socket() as s:
      s.bind(('127.0.0.1', 0))
      return s.getsockname()[1]


def child_env() -> dict:
  """Each child sees 1 CPU device and writes its output unbuffered."""
  return cpu_subprocess_env(PYTHONUNBUFFERED='1')


def command(workdir, steps, *extra):
  return [sys.executable, str(REPO / 'run.py')] + run_py_args(workdir, OVERRIDES, steps) + list(extra)


def distributed(workdir, steps, *extra, num_processes=2):
  """One command per process of a run joined through a fresh coordinator port."""
  address = f'127.0.0.1:{free_port()}'
  return [
    command(
      workdir,
      steps,
      *extra,
      f'--coordinator_address={address}',
      f'--num_processes={num_processes}',
      f'--process_id={i}',
    )
    for i in range(num_processes)
  ]


def run_all(commands, logdir: pathlib.Path, name: str) -> list[str]:
  """Runs the commands concurrently; returns their stdouts. If one fails or the time runs out,
  the others are killed and the test fails showing every process's stderr."""
  logdir.mkdir(parents=True, exist_ok=True)
  procs, logs = [], []
  for i, cmd in enumerate(commands):
    out, err = logdir / f'{name}{i}.out', logdir / f'{name}{i}.err'
    logs.append((out, err))
    with out.open('w') as out_f, err.open('w') as err_f:  # the child keeps its own copies
      procs.append(
        subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL)
      )
  deadline = time.monotonic() + TIMEOUT_S
  failure = None
  try:
    while failure is None and any(p.poll() is None for p in procs):
      if any(p.returncode not in (None, 0) for p in procs):
        failure = 'a process failed'
      elif time.monotonic() > deadline:
        failure = f'timed out after {TIMEOUT_S} s'
      else:
        time.sleep(0.2)
    if failure is None and any(p.returncode != 0 for p in procs):
      failure = 'a process failed'
  finally:  # never leave a child behind (failure, timeout or an interrupted test)
    for p in procs:
      if p.poll() is None:
        p.kill()
      p.wait()
  if failure is not None:
    report = []
    for i, (p, (_, err)) in enumerate(zip(procs, logs)):
      report.append(
        f'--- {name}{i}: {" ".join(commands[i])}\n--- exit code {p.returncode}, stderr tail:\n'
        + err.read_text()[-4000:]
      )
    pytest.fail(f'{name}: {failure}\n' + '\n'.join(report), pytrace=False)
  return [out.read_text() for out, _ in logs]


def restore(workdir, step):
  """(params as numpy, data-iterator state) of checkpoint `step` in workdir, onto 1 device."""
  config = make_config(TOTAL)
  mesh = mesh_lib.make_mesh(config.mesh, jax.devices()[:1])
  model = Transformer(config.model)
  abstract, _ = state_shardings(model, make_optimizer(config), config, mesh)
  ckpt = Checkpointer(pathlib.Path(workdir) / 'checkpoints', keep=10)
  try:
    assert ckpt.latest_step() == TOTAL
    state, data_state = ckpt.restore(step, abstract, config)
  finally:
    ckpt.close()
  assert int(state.step) == step
  return jax.tree.map(np.asarray, state.params), data_state


def make_config(steps):
  """configs/default.py with OVERRIDES, as run.py builds it."""
  spec = importlib.util.spec_from_file_location('default_config', REPO / 'configs' / 'default.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  for key, value in dict(OVERRIDES, **{'train.steps': steps}).items():
    group, name = key.split('.')
    c[group][name] = value
  return config_lib.validate(c)


@pytest.mark.long
@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  one, two = tmp_path / 'one', tmp_path / 'two'

  # The one-process reference and the first 2-process launch run side by side.
  outs = run_all([command(one, TOTAL)] + distributed(two, FIRST), tmp_path / 'logs', 'first')
  assert re.search(r"mesh \{'data': 1, 'fsdp': 1, 'tensor': 1\}", outs[0]), outs[0]
  # Two processes of one CPU device each: the mesh spans both (printed by process 0 only).
  assert re.search(r"mesh \{'data': 2, 'fsdp': 1, 'tensor': 1\}", outs[1]), outs[1]
  # Process 1 prints only its own line on joining the others (every process says what it waits for).
  assert [l for l in outs[2].splitlines() if l.startswith('kimijax:')] == [
    l for l in outs[2].splitlines() if l.startswith('kimijax: process 1 of 2 waiting up to')
  ]
  assert sorted(train_losses(two)) == list(range(1, FIRST + 1))
  assert (two / 'checkpoints' / str(FIRST)).is_dir()

  # Same command with more steps: both processes resume from the shared checkpoint. The resumed
  # run uses fsdp=2 instead of data=2, so the parameters are split across the two processes:
  # the replicated checkpoint is resharded on restore, and the final checkpoint holds half of
  # every 'embed'-axis parameter from each process.
  outs = run_all(distributed(two, TOTAL, '--config.mesh.data=1', '--config.mesh.fsdp=2'), tmp_path / 'logs', 'resume')
  assert f'resuming from step {FIRST}' in outs[0], outs[0]
  assert re.search(r"mesh \{'data': 1, 'fsdp': 2, 'tensor': 1\}", outs[0]), outs[0]

  ref, got = train_losses(one), train_losses(two)
  assert sorted(ref) == sorted(got) == list(range(1, TOTAL + 1))
  assert len(set(ref.values())) == TOTAL, f'the loss should change every step: {ref}'
  np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=RTOL, atol=0)
  ref_eval, got_eval = eval_losses(one), eval_losses(two)
  assert sorted(ref_eval) == sorted(got_eval) == [FIRST, TOTAL]
  np.testing.assert_allclose(
    [got_eval[s] for s in (FIRST, TOTAL)], [ref_eval[s] for s in (FIRST, TOTAL)], rtol=RTOL, atol=0
  )

  # The checkpoint both processes wrote together restores (on one device) to the parameters of
  # the one-process run, with the same data-iterator position. AdamW normalises updates, so an
  # entry with a ~0 gradient may differ by a fraction of one step (lr 3e-3) from summation order.
  ref_params, ref_data = restore(one, TOTAL)
  got_params, got_data = restore(two, TOTAL)
  assert got_data == ref_data
  for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_params), jax.tree.leaves(got_params)):
    np.testing.assert_allclose(g, r, rtol=0, atol=3e-4, err_msg=jax.tree_util.keystr(path))


@pytest.mark.long
@pytest.mark.slow
def test_resume_across_process_counts(tmp_path):
  """Two processes train to step 3, one process resumes to 5, two processes resume to 7: the
  checkpoint written by two processes restores in one and the reverse, and the losses are those
  of one uninterrupted process."""
  one, mixed, logs = tmp_path / 'one', tmp_path / 'mixed', tmp_path / 'logs'
  first, second = 3, FIRST

  outs = run_all([command(one, TOTAL)] + distributed(mixed, first), logs, 'two_to_3')
  assert re.search(r"mesh \{'data': 2, 'fsdp': 1, 'tensor': 1\}", outs[1]), outs[1]
  assert (mixed / 'checkpoints' / str(first)).is_dir()

  (out,) = run_all([command(mixed, second)], logs, 'one_to_5')
  assert re.search(rf"mesh \{{'data': 1, 'fsdp': 1, 'tensor': 1\}}, .*resuming from step {first}", out), out

  outs = run_all(distributed(mixed, TOTAL), logs, 'two_to_7')
  assert re.search(rf"mesh \{{'data': 2, 'fsdp': 1, 'tensor': 1\}}, .*resuming from step {second}", outs[0]), outs[0]

  # One record per step: each resume replaced nothing and repeated nothing in metrics.jsonl.
  assert [r['step'] for r in read_metrics(mixed) if 'loss' in r] == list(range(1, TOTAL + 1))
  ref, got = train_losses(one), train_losses(mixed)
  assert sorted(ref) == list(range(1, TOTAL + 1))
  assert len(set(ref.values())) == TOTAL, f'the loss should change every step: {ref}'
  np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=RTOL, atol=0)
  ref_eval, got_eval = eval_losses(one), eval_losses(mixed)
  assert sorted(ref_eval) == [FIRST, TOTAL] and sorted(got_eval) == [first, FIRST, TOTAL]
  np.testing.assert_allclose(
    [got_eval[s] for s in (FIRST, TOTAL)], [ref_eval[s] for s in (FIRST, TOTAL)], rtol=RTOL, atol=0
  )
  # The data iterator continued where each run stopped: the final checkpoints agree on it.
  assert restore(mixed, TOTAL)[1] == restore(one, TOTAL)[1]
