r"""Start N processes of one command on this machine, joined through jax.distributed.

    python -m experiments.tools.launch_local [--num_processes=2] [--gpus_per_process=1] [--log_dir=DIR] \
        -- RUN_PY_ARGS...

Each process runs `python run.py RUN_PY_ARGS --coordinator_address=127.0.0.1:PORT
--num_processes=N --process_id=I` (PORT: a free port of this machine; process 0 is the
coordinator). With GPUs, process I sees only its own GPUs (CUDA_VISIBLE_DEVICES = GPUs
I*K .. I*K+K-1 of those visible to the launcher, K = --gpus_per_process). --gpus_per_process=0
starts CPU processes of --cpu_devices_per_process devices each (JAX_PLATFORMS=cpu; run.py
joins CPU processes with gloo collectives), which is how the tests run it. With
--num_processes=1 the command runs alone, without the distributed flags: one process over its K
GPUs, the reference for "one process against several".

Every line a process writes (stdout and stderr) is printed with its index, `[1] ...`, and its
whole output goes to LOG_DIR/process_<I>.log (default LOG_DIR: a new temporary folder, named at
the start). The launcher waits for all processes. If one fails, it stops the others (SIGTERM,
SIGKILL after --grace_s) and exits with status 1 and one message naming that process, its exit
status, its log and the log's last lines. Ctrl-C (or SIGTERM) is passed on to every process as
SIGINT, so run.py finishes its step and any checkpoint save; processes still running after
--grace_s are killed, and the launcher exits with status 130. A bad launcher flag stops with
status 2 and one message before anything starts. Nothing is left running: each process runs in
its own process group, which is killed when it ends, and dies with the launcher (Linux).
The environment is passed on unchanged otherwise (e.g. NCCL_* settings).

--program runs something other than run.py: a Python script (path ending in .py) or a module
name (`experiments.foo`, run with -m); it must accept the three distributed flags above.

Runs on one host with two GPUs, one process against two: S holds what the runs share: 50 steps,
16 sequences of 4096 tokens per GPU, a learning-rate schedule that does not depend on
train.steps, one checkpoint at the end:

    S='--config.train.steps=50 --config.train.checkpoint_every=50 --config.train.log_every=5
       --config.train.eval_every=50 --config.train.plot=False --config.train.batch_size=32
       --config.optimizer.schedule=constant --config.optimizer.warmup_steps=10'
    # data parallel: one process over both GPUs, then two processes of one GPU each
    python -m experiments.tools.launch_local --num_processes=1 --gpus_per_process=2 -- \
        --config=configs/bench_350m.py --workdir=runs/mgpu/data_1proc $S
    python -m experiments.tools.launch_local --num_processes=2 --gpus_per_process=1 -- \
        --config=configs/bench_350m.py --workdir=runs/mgpu/data_2proc $S
    # fsdp (parameters, gradients and optimizer states sharded over the GPUs): the same two
    # commands with --workdir=runs/mgpu/fsdp_1proc, fsdp_2proc and
    # --config.mesh.data=1 --config.mesh.fsdp=2 at the end
    # the per-GPU reference: --num_processes=1 --gpus_per_process=1, $S --config.train.batch_size=16
    # the 3:1 KDA:attention hybrid: --config=configs/bench_350m.py:hybrid, the same runs

A two-process launch prints `launch_local: 2 processes joined at 127.0.0.1:PORT: 0 on GPU 0;
1 on GPU 1; logs in DIR/process_<i>.log`, then run.py's lines with their process index: both
processes' `[I] kimijax: process I of 2 waiting up to 300 s ...`, process 0's `[0] kimijax:
341.9M parameters, mesh {'data': 2, 'fsdp': 1, 'tensor': 1}, 131072 tokens/step, fresh start`,
its eval loss at step 50 and summary, and `launch_local: all 2 processes finished`. The losses
and tokens/s per step are in WORKDIR/metrics.jsonl (written by process 0).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from absl import app, flags

ROOT = pathlib.Path(__file__).resolve().parents[2]
FLAGS = flags.FLAGS
EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
DISTRIBUTED_FLAGS = ('--coordinator_address', '--num_processes', '--process_id', '--distributed')
TAIL_LINES = 20


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module
  next to others that define flags of the same names, e.g. run.py's --num_processes)."""
  flags.DEFINE_integer('num_processes', 2, 'processes to start (>= 1); 1 runs the command alone')
  flags.DEFINE_integer('gpus_per_process', 1, 'GPUs each process sees (CUDA_VISIBLE_DEVICES); 0: CPU processes')
  flags.DEFINE_integer(
    'cpu_devices_per_process',
    1,
    'with --gpus_per_process=0: CPU devices of each process (--xla_force_host_platform_device_count)',
  )
  # --log_dir (folder for process_<i>.log; default: a new temporary folder) is absl's own flag
  # ("directory to write logfiles into"), defined by absl.logging: the launcher reads it.
  flags.DEFINE_string(
    'program',
    'run.py',
    'what each process runs: a Python script (.py; relative '
    'to this repository, else to the current folder) or a module name (run with -m)',
  )
  flags.DEFINE_float(
    'grace_s', 10.0, 'after a failure or Ctrl-C, seconds the other processes get to exit before they are killed'
  )
  flags.DEFINE_float('timeout_s', 0.0, 'stop every process and fail after this many seconds (0: no limit)')


class LaunchError(ValueError):
  """A launcher flag or argument that cannot be used; the message names it."""


@dataclasses.dataclass
class Process:
  index: int
  command: list[str]
  env: dict[str, str]
  devices: str  # what it runs on, for the start-up line


# ----------------------------------------------------------------------------- the plan


def free_port() -> int:
  """A TCP port of 127.0.0.1 that is free now (the OS picks it)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def visible_gpus(env: dict[str, str]) -> tuple[list[str], str]:
  """(the GPUs this launcher may hand out, as CUDA_VISIBLE_DEVICES entries; where that came from).

  CUDA_VISIBLE_DEVICES when set (its entries, indices or UUIDs), else the GPUs `nvidia-smi -L`
  lists (MIG instances are not counted), else none."""
  if 'CUDA_VISIBLE_DEVICES' in env:
    value = env['CUDA_VISIBLE_DEVICES']
    return [g.strip() for g in value.split(',') if g.strip()], f'CUDA_VISIBLE_DEVICES={value!r}'
  if shutil.which('nvidia-smi') is None:
    return [], 'nvidia-smi not found and CUDA_VISIBLE_DEVICES unset'
  try:
    out = subprocess.run(['nvidia-smi', '-L'], capture_output=True, text=True, timeout=30).stdout
  except (OSError, subprocess.SubprocessError) as e:
    return [], f'nvidia-smi -L failed ({type(e).__name__})'
  gpus = [m.group(1) for m in re.finditer(r'^GPU (\d+):', out, re.MULTILINE)]
  return gpus, 'nvidia-smi -L'


def program_command(program: str, cwd: pathlib.Path) -> list[str]:
  """[python, script] or [python, -m, module]; LaunchError if it cannot be found."""
  if not program:
    raise LaunchError('--program is empty: give a Python script (.py) or a module name')
  if program.endswith('.py'):
    for base in (ROOT / program, cwd / program):
      if base.is_file():
        return [sys.executable, str(base.absolute())]
    places = ' and '.join(dict.fromkeys(str(d) for d in (cwd, ROOT)))
    raise LaunchError(f'--program={program}: no such file (looked in {places})')
  if not re.fullmatch(r'[A-Za-z_][\w.]*', program):
    raise LaunchError(f'--program={program!r} is neither a .py script nor a module name')
  return [sys.executable, '-m', program]


def plan(
  args: list[str],
  *,
  num_processes: int,
  gpus_per_process: int,
  cpu_devices_per_process: int,
  program: str,
  env: dict[str, str],
  gpus: list[str] | None = None,
  gpus_from: str = '',
  cwd: pathlib.Path | None = None,
) -> list[Process]:
  """The command and environment of every process; LaunchError on bad input, before any start.

  `gpus` (default: visible_gpus(env)) are the CUDA_VISIBLE_DEVICES entries to hand out."""
  cwd = pathlib.Path.cwd() if cwd is None else cwd
  if num_processes < 1:
    raise LaunchError(f'--num_processes={num_processes} must be >= 1')
  if gpus_per_process < 0:
    raise LaunchError(f'--gpus_per_process={gpus_per_process} must be >= 0 (0: CPU processes)')
  if cpu_devices_per_process < 1:
    raise LaunchError(f'--cpu_devices_per_process={cpu_devices_per_process} must be >= 1')
  if gpus_per_process and cpu_devices_per_process != 1:
    raise LaunchError('--cpu_devices_per_process applies to CPU processes only (--gpus_per_process=0)')
  if not args and program == 'run.py':
    raise LaunchError(
      "no command: give run.py's arguments after '--', e.g. -- --config=configs/default.py --workdir=runs/two"
    )
  if num_processes > 1:
    for a in args:
      name = a.split('=', 1)[0]
      if name in DISTRIBUTED_FLAGS:
        raise LaunchError(f'{a!r} after --: the launcher sets {", ".join(DISTRIBUTED_FLAGS[:3])} itself')
  base_command = program_command(program, cwd) + list(args)

  if gpus_per_process:
    if gpus is None:
      gpus, gpus_from = visible_gpus(env)
    need = num_processes * gpus_per_process
    if need > len(gpus):
      raise LaunchError(
        f'--num_processes={num_processes} x --gpus_per_process={gpus_per_process} needs '
        f'{need} GPU{"s" if need > 1 else ""}, but {len(gpus)} '
        f'{"is" if len(gpus) == 1 else "are"} visible ({gpus_from}); '
        '--gpus_per_process=0 starts CPU processes'
      )

  address = f'127.0.0.1:{free_port()}' if num_processes > 1 else None
  pythonpath = os.pathsep.join(p for p in (str(ROOT), env.get('PYTHONPATH', '')) if p)
  processes = []
  for i in range(num_processes):
    penv = dict(env, PYTHONUNBUFFERED='1', PYTHONPATH=pythonpath)
    if gpus_per_process:
      mine = gpus[i * gpus_per_process : (i + 1) * gpus_per_process]
      penv['CUDA_VISIBLE_DEVICES'] = ','.join(mine)
      devices = f'GPU {",".join(mine)}'
    else:
      penv['JAX_PLATFORMS'] = 'cpu'
      penv['CUDA_VISIBLE_DEVICES'] = ''  # a CUDA jaxlib must not take a GPU either
      xla = re.sub(r'--xla_force_host_platform_device_count=\S*', '', env.get('XLA_FLAGS', '')).split()
      penv['XLA_FLAGS'] = ' '.join(xla + [f'--xla_force_host_platform_device_count={cpu_devices_per_process}'])
      devices = f'{cpu_devices_per_process} CPU device{"s" if cpu_devices_per_process > 1 else ""}'
    command = list(base_command)
    if address:
      command += [f'--coordinator_address={address}', f'--num_processes={num_processes}', f'--process_id={i}']
    processes.append(Process(i, command, penv, devices))
  return processes


# ----------------------------------------------------------------------------- running them


def _prctl():
  try:
    return ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith('linux') else None
  except (OSError, AttributeError):
    return None


_PRCTL = _prctl()  # looked up here, not in the forked child
PR_SET_PDEATHSIG = 1


def _die_with_parent():
  """In the child before exec: SIGKILL when the launcher dies (Linux)."""
  if _PRCTL is not None:
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL)


def _screen_line(raw: bytes) -> str:
  """A line as a terminal would leave it: the text after its last carriage return (progress bars)."""
  text = raw.decode('utf-8', 'replace').rstrip('\n')
  parts = [p for p in text.split('\r') if p.strip()]
  return parts[-1] if parts else ''


class Launch:
  """Running processes: their output pumps, their exits and stopping them."""

  def __init__(self, processes: list[Process], log_dir: pathlib.Path, out=None):
    self.processes, self.log_dir = processes, log_dir
    self.out = out or sys.stdout
    self.width = len(str(len(processes) - 1))
    self.lock = threading.Lock()
    self.popens: list[subprocess.Popen] = []
    self.pumps: list[threading.Thread] = []
    self.codes: dict[int, int] = {}  # index -> exit status, once reaped
    self.sent: dict[int, set[int]] = {}  # index -> signals the launcher sent it while it ran

  def log_path(self, i: int) -> pathlib.Path:
    return self.log_dir / f'process_{i}.log'

  def start(self) -> None:
    for p in self.processes:  # every process first, then the pumps (no threads around a fork)
      self.popens.append(
        subprocess.Popen(
          p.command,
          env=p.env,
          stdin=subprocess.DEVNULL,
          stdout=subprocess.PIPE,
          stderr=subprocess.STDOUT,
          start_new_session=True,
          preexec_fn=_die_with_parent,
        )
      )
    for p, popen in zip(self.processes, self.popens):
      t = threading.Thread(target=self._pump, args=(p.index, popen.stdout), daemon=True)
      t.start()
      self.pumps.append(t)

  def _pump(self, i: int, stream) -> None:
    prefix = f'[{i:>{self.width}}] '
    with self.log_path(i).open('wb') as log:
      console = True
      for raw in iter(stream.readline, b''):  # read to the end, so that the process never blocks
        log.write(raw)
        log.flush()
        if console:
          try:
            with self.lock:
              self.out.write(prefix + _screen_line(raw) + '\n')
              self.out.flush()
          except (OSError, ValueError):  # the console went away: keep the log
            console = False
    stream.close()

  def running(self) -> list[int]:
    return [i for i in range(len(self.popens)) if i not in self.codes]

  def reap_exited(self) -> list[int]:
    """Indices of processes that ended since the last call, in index order. A process's group
    is killed before it is reaped (while its id cannot be reused), so nothing it started
    outlives it."""
    ended = []
    for i in self.running():
      pid = self.popens[i].pid
      try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
      except ChildProcessError:  # reaped already (not by this class): its id may be reused
        self.codes[i] = self.popens[i].wait()
        ended.append(i)
        continue
      if info is None:
        continue
      sent = set(self.sent.get(i, ()))
      self._signal_group(i, signal.SIGKILL)  # what it started, if anything is left
      self.sent[i] = sent
      self.codes[i] = self.popens[i].wait()
      ended.append(i)
    return ended

  def _signal_group(self, i: int, sig) -> None:
    if i in self.codes:  # reaped: its id may belong to another process now
      return
    self.sent.setdefault(i, set()).add(int(sig))
    try:
      os.killpg(self.popens[i].pid, sig)
    except (ProcessLookupError, PermissionError):
      pass

  def stop(self, first_signal, grace_s: float) -> None:
    """Sends first_signal to every running process, waits up to grace_s for them to end (a
    second Ctrl-C cuts the wait short), then kills the rest; reaps all."""
    for i in self.running():
      self._signal_group(i, first_signal)
    deadline = time.monotonic() + grace_s
    try:
      while self.running() and time.monotonic() < deadline:
        self.reap_exited()
        time.sleep(0.05)
    except KeyboardInterrupt:
      pass
    finally:
      for i in self.running():
        self._signal_group(i, signal.SIGKILL)
      while self.running():
        self.reap_exited()
        time.sleep(0.01)
      self.join_pumps()

  def join_pumps(self) -> None:
    for t in self.pumps:
      t.join(timeout=5)

  def describe(self, i: int) -> str:
    return describe_exit(self.codes[i], self.sent.get(i, set()))

  def tail(self, i: int, n: int = TAIL_LINES) -> str:
    try:
      lines = self.log_path(i).read_bytes().rstrip(b'\n').split(b'\n')
    except OSError:
      return ''
    return ''.join(f'    {_screen_line(l)}\n' for l in lines[-n:])


def describe_exit(code: int, sent: set[int] = frozenset()) -> str:
  """'exited with status 1', 'was killed by SIGKILL (out of memory?)', ... ; `sent`: the signals
  the launcher sent the process, so that its own kills are told apart."""
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = str(-code)
    if -code in sent:
      return f'was stopped by the launcher ({name})'
    return f'was killed by {name}' + (' (out of memory?)' if -code == signal.SIGKILL else '')
  return f'exited with status {code}'


class _Terminated(Exception):
  """SIGTERM to the launcher."""


def _raise_terminated(signum, frame):
  del signum, frame
  raise _Terminated


def launch(
  processes: list[Process], log_dir: pathlib.Path, *, grace_s: float, timeout_s: float, out=None, err=None
) -> int:
  """Runs the processes to the end; returns the launcher's exit status (0, 1 or 130), having
  printed one message to `err` (default stderr) unless all succeeded."""
  err = err or sys.stderr
  say = lambda text: print(f'launch_local: {text}', file=err, flush=True)
  n = len(processes)
  log_dir.mkdir(parents=True, exist_ok=True)
  run = Launch(processes, log_dir, out)
  address = next((a.split('=', 1)[1] for a in processes[0].command if a.startswith('--coordinator_address=')), None)
  say(
    f'{n} process{"es" if n > 1 else ""}'
    + (f' joined at {address}' if address else '')
    + ': '
    + '; '.join(f'{p.index} on {p.devices}' for p in processes)
    + f'; logs in {log_dir}/process_<i>.log'
  )
  # SIGINT explicitly too: started with it ignored (a background job of a shell script), Python
  # would not raise KeyboardInterrupt, and the processes would inherit the ignoring.
  previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
  previous_term = signal.signal(signal.SIGTERM, _raise_terminated)
  started = time.monotonic()
  try:
    run.start()
    while True:
      for i in run.reap_exited():
        if run.codes[i] != 0:
          return _fail(run, i, grace_s, say)
      if not run.running():
        run.join_pumps()
        say(f'all {n} processes finished (logs in {log_dir})')
        return 0
      if timeout_s and time.monotonic() - started > timeout_s:
        left = run.running()
        run.stop(signal.SIGTERM, grace_s)
        say(
          f'timed out after --timeout_s={timeout_s:g} s; stopped process{"es" if len(left) > 1 else ""} '
          f'{", ".join(map(str, left))}, still running (logs in {log_dir})'
        )
        return EXIT_FAILED
      time.sleep(0.05)
  except (KeyboardInterrupt, _Terminated) as e:
    what = 'Ctrl-C' if isinstance(e, KeyboardInterrupt) else 'SIGTERM'
    say(
      f'{what}: passing SIGINT on to the processes (they stop after their step and any checkpoint '
      f'save); killing those still running after --grace_s={grace_s:g} s'
    )
    run.stop(signal.SIGINT, grace_s)
    say('stopped: ' + ', '.join(f'process {i} {run.describe(i)}' for i in sorted(run.codes)))
    return EXIT_INTERRUPTED
  finally:
    signal.signal(signal.SIGTERM, previous_term)
    signal.signal(signal.SIGINT, previous_int)
    if run.running():  # an unexpected error in the launcher itself: leave nothing behind
      run.stop(signal.SIGKILL, 0)


def _fail(run: Launch, i: int, grace_s: float, say) -> int:
  """Stops the others after process i failed; the one message; EXIT_FAILED."""
  ended_before = {j: c for j, c in run.codes.items() if j != i}
  run.stop(signal.SIGTERM, grace_s)

  def other(j):
    if j not in ended_before:
      return f'{j} {run.describe(j)}'
    return f'{j} had finished' if ended_before[j] == 0 else f'{j} {describe_exit(ended_before[j])} on its own'

  others = [other(j) for j in range(len(run.processes)) if j != i]
  say(
    f'process {i} of {len(run.processes)} failed: it {run.describe(i)}'
    + (f' (other processes: {", ".join(others)})' if others else '')
    + f'. Its log is {run.log_path(i)}; last lines:\n'
    + run.tail(i).rstrip('\n')
  )
  return EXIT_FAILED


def main(argv):
  args = argv[1:]
  env = dict(os.environ)
  try:
    processes = plan(
      args,
      num_processes=FLAGS.num_processes,
      gpus_per_process=FLAGS.gpus_per_process,
      cpu_devices_per_process=FLAGS.cpu_devices_per_process,
      program=FLAGS.program,
      env=env,
    )
    if FLAGS.grace_s < 0:
      raise LaunchError(f'--grace_s={FLAGS.grace_s} must be >= 0')
    if FLAGS.timeout_s < 0:
      raise LaunchError(f'--timeout_s={FLAGS.timeout_s} must be >= 0 (0: no limit)')
    if FLAGS.log_dir:
      log_dir = pathlib.Path(FLAGS.log_dir)
      if log_dir.exists() and not log_dir.is_dir():
        raise LaunchError(f'--log_dir={log_dir} exists and is not a folder')
    else:
      log_dir = pathlib.Path(tempfile.mkdtemp(prefix='launch_local_'))
  except LaunchError as e:
    print(f'launch_local: error: {e}', file=sys.stderr, flush=True)
    return EXIT_USAGE
  return launch(processes, log_dir, grace_s=FLAGS.grace_s, timeout_s=FLAGS.timeout_s)


def parse_flags(argv: list[str]) -> list[str]:
  """absl's parsing, with status 2 and a hint for a flag meant for the command."""
  try:
    return FLAGS(argv)
  except flags.Error as e:
    print(f"launch_local: error: {e} (the command's own flags go after '--')", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


if __name__ == '__main__':
  define_flags()
  app.run(lambda argv: sys.exit(main(argv)), flags_parser=parse_flags)
