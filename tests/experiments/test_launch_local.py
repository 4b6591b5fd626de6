"""experiments/tools/launch_local.py: N local processes of one command, their logs, their failures.

The training test runs the launcher itself (CPU processes of one device each, as
tests/train/test_multiprocess.py starts them by hand): two processes log what each process
says, prefixed with its index, into one stream and one file each, and train the same losses as
one process. The failure tests use a small stand-in program (no JAX) to make one process fail or
hang, and check the message and that nothing is left running.
"""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from helpers import eval_losses, run_py_args, tiny_run_overrides, train_losses

from experiments.tools import launch_local

REPO = pathlib.Path(__file__).resolve().parents[2]
LAUNCHER = [sys.executable, str(REPO / 'experiments' / 'tools' / 'launch_local.py')]
TIMEOUT_S = 240
STEPS = 3
RTOL = 1e-5  # as tests/train/test_multiprocess.py: two processes sum the batch in another order


def start(args, tmp_path: pathlib.Path, name: str, env=None) -> subprocess.Popen:
  """The launcher with `args`, from the repository root; stdout and stderr into tmp_path/name.*"""
  out, err = (tmp_path / f'{name}.out').open('w'), (tmp_path / f'{name}.err').open('w')
  with out, err:  # the child keeps its own copies
    return subprocess.Popen(
      LAUNCHER + list(args),
      cwd=REPO,
      stdout=out,
      stderr=err,
      stdin=subprocess.DEVNULL,
      env=dict(os.environ, **(env or {})),
    )


def finish(proc: subprocess.Popen, tmp_path: pathlib.Path, name: str, timeout=TIMEOUT_S):
  """(exit status, stdout, stderr) of a launcher started by start()."""
  try:
    proc.wait(timeout=timeout)
  finally:
    if proc.poll() is None:  # its processes die with it (PR_SET_PDEATHSIG)
      proc.kill()
      proc.wait()
  return proc.returncode, (tmp_path / f'{name}.out').read_text(), (tmp_path / f'{name}.err').read_text()


def gone(pid: int) -> bool:
  """The process has ended (a zombie waiting for its new parent to reap it counts as ended)."""
  try:
    return pathlib.Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] in 'ZX'
  except OSError:
    return True


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
@pytest.mark.long
def test_two_processes_log_and_train_like_one(tmp_path):
  overrides = tiny_run_overrides(STEPS)
  two, one = tmp_path / 'two', tmp_path / 'one'
  # Both launches side by side: 2 processes against 1 (which gets no distributed flags).
  procs = {
    'two': start(
      ['--num_processes=2', '--gpus_per_process=0', f'--log_dir={tmp_path / "logs2"}', '--']
      + run_py_args(two, overrides, STEPS),
      tmp_path,
      'two',
    ),
    'one': start(
      ['--num_processes=1', '--gpus_per_process=0', f'--log_dir={tmp_path / "logs1"}', '--']
      + run_py_args(one, overrides, STEPS),
      tmp_path,
      'one',
    ),
  }
  results = {name: finish(p, tmp_path, name) for name, p in procs.items()}
  for name, (code, out, err) in results.items():
    assert code == 0, f'{name}: exit {code}\n{err}\n{out[-4000:]}'

  code, out, err = results['two']
  lines = out.splitlines()
  assert all(re.match(r'\[[01]\] ', l) for l in lines), [l for l in lines if not re.match(r'\[[01]\] ', l)]
  # Process 0 prints the run (its mesh spans both processes); process 1 only its joining line.
  assert any(re.match(r"\[0\] kimijax: .* mesh \{'data': 2, 'fsdp': 1, 'tensor': 1\}", l) for l in lines), out
  assert any(l.startswith('[0] kimijax: process 0 of 2 waiting up to') for l in lines), out
  assert [l for l in lines if l.startswith('[1]') and 'kimijax:' in l] == [
    l for l in lines if l.startswith('[1] kimijax: process 1 of 2 waiting up to')
  ], out
  assert 'launch_local: all 2 processes finished' in err, err
  # Each process's whole log, unprefixed, in its own file.
  logs = sorted(p.name for p in (tmp_path / 'logs2').iterdir())
  assert logs == ['process_0.log', 'process_1.log']
  log0, log1 = ((tmp_path / 'logs2' / f'process_{i}.log').read_text() for i in (0, 1))
  assert re.search(r"^kimijax: .* mesh \{'data': 2", log0, re.MULTILINE), log0
  assert re.search(r'^kimijax: process 1 of 2 waiting up to', log1, re.MULTILINE), log1
  assert 'mesh' not in log1

  code, out, err = results['one']
  assert re.search(r"^\[0\] kimijax: .* mesh \{'data': 1, 'fsdp': 1, 'tensor': 1\}", out, re.MULTILINE), out
  assert 'waiting up to' not in out and '[1]' not in out

  ref, got = train_losses(one), train_losses(two)
  assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
  assert len(set(ref.values())) == STEPS, ref
  np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=RTOL, atol=0)
  assert sorted(eval_losses(one)) == sorted(eval_losses(two)) == [STEPS]
  np.testing.assert_allclose(eval_losses(two)[STEPS], eval_losses(one)[STEPS], rtol=RTOL, atol=0)


# ----------------------------------------------------------------------------- failures


# Stands in for run.py: takes the distributed flags, writes "<pid> <child pid>" (it starts a
# `sleep` child, to check that the launcher ends the whole process group), then acts by --act_<i>:
# 'sleep' (default), 'fail' (once process 0 has written its pids: a line, exit status 3) or
# 'ignore_sigint' (sleeps through SIGINT).
STAND_IN = textwrap.dedent("""
    import os, pathlib, signal, subprocess, sys, time
    args = dict(a[2:].split('=', 1) for a in sys.argv[1:])
    i = int(args['process_id'])
    act = args.get(f'act_{i}', 'sleep')
    if act == 'ignore_sigint':
      signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = subprocess.Popen(['sleep', '300'])
    pathlib.Path(args['pids'], f'{i}.tmp').write_text(f'{os.getpid()} {child.pid}')
    os.rename(pathlib.Path(args['pids'], f'{i}.tmp'), pathlib.Path(args['pids'], str(i)))
    print(f'process {i} started', flush=True)
    if act == 'fail':
      deadline = time.monotonic() + 60
      while not pathlib.Path(args['pids'], '0').exists() and time.monotonic() < deadline:
        time.sleep(0.05)
      print('stand-in: something went wrong in process 1', file=sys.stderr, flush=True)
      sys.exit(3)
    time.sleep(300)
""")


def stand_in(tmp_path: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
  script, pids = tmp_path / 'stand_in.py', tmp_path / 'pids'
  script.write_text(STAND_IN)
  pids.mkdir()
  return script, pids


def all_pids(pids: pathlib.Path) -> list[int]:
  return [int(x) for f in sorted(pids.iterdir()) if not f.name.endswith('.tmp') for x in f.read_text().split()]


def test_a_failing_process_stops_the_others(tmp_path):
  script, pids = stand_in(tmp_path)
  started = time.monotonic()
  proc = start(
    [
      '--num_processes=2',
      '--gpus_per_process=0',
      f'--program={script}',
      '--grace_s=5',
      f'--log_dir={tmp_path / "logs"}',
      '--',
      f'--pids={pids}',
      '--act_1=fail',
    ],
    tmp_path,
    'fail',
  )
  code, out, err = finish(proc, tmp_path, 'fail', timeout=60)
  assert code == 1, err
  assert time.monotonic() - started < 30  # process 0 was stopped, not waited for
  message = [l for l in err.splitlines() if 'failed' in l]
  assert message == [
    f'launch_local: process 1 of 2 failed: it exited with status 3 (other processes: 0 was '
    f'stopped by the launcher (SIGTERM)). Its log is {tmp_path / "logs" / "process_1.log"}; '
    'last lines:'
  ], err
  assert err.rstrip().splitlines()[-1] == '    stand-in: something went wrong in process 1', err
  assert '[1] stand-in: something went wrong in process 1' in out.splitlines()
  assert len(all_pids(pids)) == 4
  assert all(gone(pid) for pid in all_pids(pids)), [pid for pid in all_pids(pids) if not gone(pid)]


def test_a_bad_config_key_names_the_process(tmp_path):
  """Through run.py: both processes stop on the unknown key; the launcher names one of them."""
  args = run_py_args(tmp_path / 'run', tiny_run_overrides(STEPS), STEPS) + ['--config.train.no_such_key=1']
  proc = start(
    ['--num_processes=2', '--gpus_per_process=0', f'--log_dir={tmp_path / "logs"}', '--', *args], tmp_path, 'bad'
  )
  code, out, err = finish(proc, tmp_path, 'bad', timeout=120)
  assert code == 1, err
  failed = re.search(
    r'^launch_local: process ([01]) of 2 failed: it exited with status 1 .*Its log is (\S+);', err, re.MULTILINE
  )
  assert failed, err
  assert failed.group(2) == str(tmp_path / 'logs' / f'process_{failed.group(1)}.log')
  tail = err[failed.end() :]
  assert 'train.no_such_key' in tail, err
  assert not (tmp_path / 'run').exists()  # stopped before anything was written


def test_ctrl_c_stops_every_process(tmp_path):
  """SIGINT is passed on; a process that ignores it is killed after --grace_s; status 130."""
  script, pids = stand_in(tmp_path)
  proc = start(
    [
      '--num_processes=2',
      '--gpus_per_process=0',
      f'--program={script}',
      '--grace_s=1',
      f'--log_dir={tmp_path / "logs"}',
      '--',
      f'--pids={pids}',
      '--act_0=ignore_sigint',
    ],
    tmp_path,
    'int',
  )
  deadline = time.monotonic() + 60
  while len([f for f in pids.iterdir() if not f.name.endswith('.tmp')]) < 2 and proc.poll() is None:
    assert time.monotonic() < deadline, 'the stand-ins did not start'
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  code, out, err = finish(proc, tmp_path, 'int', timeout=60)
  assert code == 130, err
  assert (
    'launch_local: stopped: process 0 was stopped by the launcher (SIGKILL), process 1 was stopped by '
    'the launcher (SIGINT)'
  ) in err.splitlines(), err
  assert len(all_pids(pids)) == 4
  assert all(gone(pid) for pid in all_pids(pids)), [pid for pid in all_pids(pids) if not gone(pid)]


# ----------------------------------------------------------------------------- bad input


PROBE = "import pathlib, sys; pathlib.Path(sys.argv[1].split('=', 1)[1]).write_text('started')\n"


@pytest.mark.parametrize(
  'args, env, message',
  [
    (['--num_processes=0', '--gpus_per_process=0'], {}, '--num_processes=0 must be >= 1'),
    (['--gpus_per_process=-1'], {}, '--gpus_per_process=-1 must be >= 0 (0: CPU processes)'),
    (
      ['--num_processes=2', '--gpus_per_process=1'],
      {'CUDA_VISIBLE_DEVICES': '0'},
      "--num_processes=2 x --gpus_per_process=1 needs 2 GPUs, but 1 is visible (CUDA_VISIBLE_DEVICES='0')",
    ),
    (
      ['--num_processes=3', '--gpus_per_process=2'],
      {'CUDA_VISIBLE_DEVICES': '0,1,2,3'},
      '--num_processes=3 x --gpus_per_process=2 needs 6 GPUs, but 4 are visible',
    ),
    (['--gpus_per_process=0', '--timeout_s=-1'], {}, '--timeout_s=-1.0 must be >= 0'),
    (
      ['--gpus_per_process=0', '--process_id=1'],
      {},
      "Unknown command line flag 'process_id' (the command's own flags go after '--')",
    ),
  ],
  ids=['no_processes', 'negative_gpus', 'too_few_gpus', 'too_few_gpus_2', 'timeout', 'flag_before_dashes'],
)
def test_bad_flags_stop_before_anything_starts(tmp_path, args, env, message):
  probe, marker = tmp_path / 'probe.py', tmp_path / 'started'
  probe.write_text(PROBE)
  proc = start(
    args + [f'--program={probe}', f'--log_dir={tmp_path / "logs"}', '--', f'--marker={marker}'], tmp_path, 'bad', env
  )
  code, out, err = finish(proc, tmp_path, 'bad', timeout=60)
  assert code == 2, err
  assert err.splitlines() == [f'launch_local: error: {message}'] or (
    len(err.splitlines()) == 1 and err.startswith(f'launch_local: error: {message}')
  ), err
  assert out == '' and not marker.exists() and not (tmp_path / 'logs').exists()


@pytest.mark.parametrize(
  'args, message',
  [
    (['--gpus_per_process=0'], "no command: give run.py's arguments after '--'"),
    (
      ['--gpus_per_process=0', '--program=no_such_script.py', '--', '--x=1'],
      '--program=no_such_script.py: no such file',
    ),
    (
      ['--gpus_per_process=0', '--', '--config=configs/default.py', '--num_processes=2'],
      "'--num_processes=2' after --: the launcher sets --coordinator_address, --num_processes, --process_id itself",
    ),
  ],
  ids=['no_command', 'no_program', 'distributed_flag_after_dashes'],
)
def test_bad_commands_stop_before_anything_starts(tmp_path, args, message):
  proc = start(args[:1] + [f'--log_dir={tmp_path / "logs"}'] + args[1:], tmp_path, 'bad')
  code, out, err = finish(proc, tmp_path, 'bad', timeout=60)
  assert code == 2, err
  assert len(err.splitlines()) == 1 and err.startswith(f'launch_local: error: {message}'), err
  assert out == '' and not (tmp_path / 'logs').exists()


# ----------------------------------------------------------------------------- the plan, in-process


def test_plan_hands_out_gpus_and_flags():
  env = {'PATH': '/usr/bin', 'NCCL_NVLS_ENABLE': '0'}
  procs = launch_local.plan(
    ['--config=c.py'],
    num_processes=2,
    gpus_per_process=2,
    cpu_devices_per_process=1,
    program='run.py',
    env=env,
    gpus=['0', '1', '2', '3'],
    gpus_from='test',
  )
  assert [p.env['CUDA_VISIBLE_DEVICES'] for p in procs] == ['0,1', '2,3']
  assert all(p.env['NCCL_NVLS_ENABLE'] == '0' and 'JAX_PLATFORMS' not in p.env for p in procs)
  address = procs[0].command[-3]
  assert re.fullmatch(r'--coordinator_address=127\.0\.0\.1:\d+', address)
  for i, p in enumerate(procs):
    assert p.command == [
      sys.executable,
      str(REPO / 'run.py'),
      '--config=c.py',
      address,
      '--num_processes=2',
      f'--process_id={i}',
    ]
  # One process: the command alone, over both GPUs.
  (only,) = launch_local.plan(
    ['--config=c.py'],
    num_processes=1,
    gpus_per_process=2,
    cpu_devices_per_process=1,
    program='run.py',
    env=env,
    gpus=['0', '1'],
  )
  assert only.command == [sys.executable, str(REPO / 'run.py'), '--config=c.py']
  assert only.env['CUDA_VISIBLE_DEVICES'] == '0,1'
  # CPU processes: their own device count, whatever XLA_FLAGS said, and no GPU.
  cpu = launch_local.plan(
    ['--x'],
    num_processes=2,
    gpus_per_process=0,
    cpu_devices_per_process=2,
    program='run.py',
    env=dict(env, XLA_FLAGS='--xla_force_host_platform_device_count=8 --a=1'),
  )
  for p in cpu:
    assert p.env['JAX_PLATFORMS'] == 'cpu' and p.env['CUDA_VISIBLE_DEVICES'] == ''
    assert p.env['XLA_FLAGS'] == '--a=1 --xla_force_host_platform_device_count=2'
  # A module as the program.
  (mod,) = launch_local.plan(
    [], num_processes=1, gpus_per_process=0, cpu_devices_per_process=1, program='experiments.bench.bench_train', env=env
  )
  assert mod.command == [sys.executable, '-m', 'experiments.bench.bench_train']
