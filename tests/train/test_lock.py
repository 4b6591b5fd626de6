"""The workdir lock (kimijax.train.lock): a live holder stops a second run with its host, pid
and start time; a dead holder's lock is reclaimed; a reused pid is not mistaken for the holder."""

import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from kimijax.train.lock import LOCK_NAME, WorkdirError, WorkdirLock, WorkdirLockedError, _start_ticks, check_workdir


def _write_lock(workdir, **info):
  holder = {'host': socket.gethostname(), 'started': '2026-12-01T09:00:00+00:00', 'command': 'run.py ...', **info}
  (workdir / LOCK_NAME).write_text(json.dumps(holder))
  return holder


@pytest.fixture
def live_process():
  proc = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
  yield proc
  proc.kill()
  proc.wait()


def test_live_holder_stops_a_second_run_with_host_pid_and_start(tmp_path, live_process):
  _write_lock(tmp_path, pid=live_process.pid, ticks=_start_ticks(live_process.pid))
  with pytest.raises(WorkdirLockedError) as info:
    WorkdirLock(tmp_path).acquire()
  message = str(info.value)
  for part in (str(tmp_path), socket.gethostname(), f'pid {live_process.pid}', '2026-12-01T09:00:00'):
    assert part in message, (part, message)
  assert json.loads((tmp_path / LOCK_NAME).read_text())['pid'] == live_process.pid  # left alone


def test_lock_of_a_dead_process_is_reclaimed(tmp_path, capsys):
  dead = subprocess.Popen([sys.executable, '-c', 'pass'])
  dead.wait()
  _write_lock(tmp_path, pid=dead.pid, ticks=12345)
  with WorkdirLock(tmp_path) as lock:
    held = json.loads((tmp_path / LOCK_NAME).read_text())
    assert held['pid'] == os.getpid() and held['host'] == socket.gethostname() and held['started']
    assert lock.held
  assert not (tmp_path / LOCK_NAME).exists()  # released at the end
  assert 'reclaimed a stale lock' in capsys.readouterr().out
  assert not list(tmp_path.glob(f'{LOCK_NAME}.stale.*'))


def test_reused_pid_is_not_the_holder(tmp_path, live_process):
  """A live pid whose process started at another time than the lock says is a reused pid."""
  _write_lock(tmp_path, pid=live_process.pid, ticks=_start_ticks(live_process.pid) - 1)
  with WorkdirLock(tmp_path):
    assert json.loads((tmp_path / LOCK_NAME).read_text())['pid'] == os.getpid()


def test_lock_from_another_host_is_not_reclaimed(tmp_path):
  _write_lock(tmp_path, host='elsewhere-node-7', pid=1, ticks=None)
  with pytest.raises(WorkdirLockedError, match='another host.*delete'):
    WorkdirLock(tmp_path).acquire()


def test_second_lock_in_one_process_fails_until_released(tmp_path):
  first = WorkdirLock(tmp_path)
  first.acquire()
  with pytest.raises(WorkdirLockedError):
    WorkdirLock(tmp_path).acquire()
  first.release()
  with WorkdirLock(tmp_path):
    pass


def test_workdir_that_is_a_file(tmp_path):
  path = tmp_path / 'a_file'
  path.write_text('x')
  with pytest.raises(WorkdirError, match='exists and is not a folder'):
    check_workdir(path)
  with pytest.raises(WorkdirError, match=f'lies under {path}, which is a file'):
    check_workdir(path / 'run' / 'sub')
  check_workdir(tmp_path / 'new' / 'run')  # folders still to be made: fine


def test_train_refuses_a_locked_workdir_before_any_compute(tmp_path, live_process):
  from tiny_config import TINY, make_config

  from kimijax.train.loop import train

  _write_lock(tmp_path, pid=live_process.pid, ticks=_start_ticks(live_process.pid))
  with pytest.raises(WorkdirLockedError):
    train(make_config({**TINY, 'train.steps': 2}), tmp_path, devices=jax.devices()[:1])
  assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing written
