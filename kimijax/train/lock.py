"""A lock on a run's workdir, so that two runs never write one folder's metrics and checkpoints.

    with WorkdirLock(workdir):        # raises WorkdirLockedError naming the holder
      train ...

The lock is DIR/run.lock, created atomically (O_CREAT | O_EXCL) and holding the holder's host,
pid, start time and its process start ticks (from /proc, to tell a live holder from a new
process that reuses a dead one's pid). A lock whose holder is on this host and no longer running
is stale: it is moved aside atomically (rename to a name only this process uses) and the lock
is taken again with O_EXCL, so two processes that find the same stale lock cannot both take it.
A lock held from another host cannot be checked from here; the message says how to remove it.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket

LOCK_NAME = 'run.lock'


class WorkdirError(RuntimeError):
  """A --workdir that cannot be used; the message names the path."""


class WorkdirLockedError(WorkdirError):
  """The workdir is in use by another run."""


def check_workdir(workdir: str | pathlib.Path) -> None:
  """Raises WorkdirError if `workdir`, or the nearest of its parents that exists, is not a folder."""
  path = pathlib.Path(workdir)
  if path.exists() and not path.is_dir():
    raise WorkdirError(f'--workdir {path} exists and is not a folder; give a new or existing folder')
  existing = next((p for p in path.absolute().parents if p.exists()), None)
  if existing is not None and not existing.is_dir():
    raise WorkdirError(f'--workdir {path} lies under {existing}, which is a file; give a folder path')


def _start_ticks(pid: int) -> int | None:
  """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
  try:
    stat = pathlib.Path(f'/proc/{pid}/stat').read_text()
  except OSError:
    return None
  return int(stat.rsplit(')', 1)[1].split()[19])


def _alive(pid: int, ticks: int | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # someone else's live process
  now = _start_ticks(pid)
  return ticks is None or now is None or now == ticks  # same pid, another process: not the holder


def describe(holder: dict) -> str:
  return f'host {holder.get("host")}, pid {holder.get("pid")}, started {holder.get("started")}' + (
    f', {holder.get("command")}' if holder.get('command') else ''
  )


class WorkdirLock:
  def __init__(self, workdir: str | pathlib.Path, command: str = ''):
    self.path = pathlib.Path(workdir) / LOCK_NAME
    self.command = command
    self.held = False

  def _create(self) -> bool:
    info = {
      'host': socket.gethostname(),
      'pid': os.getpid(),
      'ticks': _start_ticks(os.getpid()),
      'started': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
      'command': self.command,
    }
    try:
      fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    with os.fdopen(fd, 'w') as f:
      f.write(json.dumps(info))
    return True

  def _holder(self) -> dict:
    try:
      return json.loads(self.path.read_text())
    except (OSError, ValueError):
      return {}  # being written right now, or unreadable: treated as held

  def acquire(self) -> None:
    self.path.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(3):
      if self._create():
        self.held = True
        return
      holder = self._holder()
      same_host = holder.get('host') == socket.gethostname()
      if not (same_host and isinstance(holder.get('pid'), int) and not _alive(holder['pid'], holder.get('ticks'))):
        break
      aside = self.path.with_name(f'{LOCK_NAME}.stale.{os.getpid()}')
      try:
        os.replace(self.path, aside)  # atomic: of several reclaimers only one moves this lock
      except FileNotFoundError:
        continue  # another process moved it first; try to create again
      try:
        moved = json.loads(aside.read_text())
      except (OSError, ValueError):
        moved = {}
      if (moved.get('pid'), moved.get('started')) != (holder.get('pid'), holder.get('started')):
        # Another process reclaimed the stale lock and took a fresh one in between: put that
        # one back (link fails rather than overwrite if yet another lock exists meanwhile).
        try:
          os.link(aside, self.path)
        except FileExistsError:
          pass
        aside.unlink(missing_ok=True)
        break
      aside.unlink(missing_ok=True)
      print(f'kimijax: reclaimed a stale lock on {self.path.parent} ({describe(holder)}; not running)', flush=True)
    holder = self._holder()
    where = (
      ''
      if holder.get('host') in (None, socket.gethostname())
      else (f'; it is on another host, so it cannot be checked from here: if that run is gone, delete {self.path}')
    )
    raise WorkdirLockedError(
      f'workdir {self.path.parent} is in use by another run ({describe(holder)}){where}; '
      'wait for it to finish or use another --workdir'
    )

  def release(self) -> None:
    if self.held:
      self.path.unlink(missing_ok=True)
      self.held = False

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()
