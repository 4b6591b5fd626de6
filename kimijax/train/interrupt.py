"""Stop signals as a request to stop between steps, so no step or checkpoint save is torn.

    with StopOnInterrupt(grace_s=25.0, on_expiry=lock.release) as stop:
      for step in ...:
        ...
        if stop.requested:
          save a checkpoint of this step, wait for it, raise Interrupted(...)

The signals (STOP_SIGNALS): Ctrl-C (SIGINT), SIGTERM (what cluster schedulers, Kubernetes and
`timeout` send before they kill a job) and SIGUSR1 (the preemption notice some schedulers send
ahead of time, e.g. SLURM's `--signal=USR1@60`). Inside the block the first one only sets
`requested` and `signum` and says so; the loop then finishes the step, saves a checkpoint of it,
waits for the save and raises Interrupted, which run.py turns into a message and the conventional
exit status 128 + the signal's number (130 for SIGINT, 143 for SIGTERM, 138 for SIGUSR1). A second
signal raises StopNow (a KeyboardInterrupt) at once; the last complete checkpoint stays (orbax never
exposes a half-written one).

`grace_s` bounds the whole stop: a thread that sees the signal the moment it arrives (even while
the main thread is inside a long compile, where Python's own handlers wait) calls `on_expiry` (the
run releases its workdir lock) and ends the process with that status if the step and its save have
not finished grace_s seconds after the signal, so that a scheduler's SIGKILL never finds the run
still holding its lock. grace_s=0: no limit. Outside the main thread (where signal handlers cannot
be set) the block does nothing and the signals keep their usual meaning.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def exit_status(signum: int) -> int:
  """The shell's status for a process stopped by `signum`: 128 + its number."""
  return 128 + int(signum)


def signal_name(signum: int) -> str:
  return 'Ctrl-C' if signum == signal.SIGINT else signal.Signals(signum).name


class StopNow(KeyboardInterrupt):
  """A second stop signal: stop at once, without waiting for the step or a save."""

  def __init__(self, signum: int):
    super().__init__(signal_name(signum))
    self.signum = signum


class Interrupted(Exception):
  """Training stopped on a stop signal; carries the step reached, the last complete checkpoint
  and the signal."""

  def __init__(self, step: int, checkpoint_step: int | None, checkpoint_dir, signum: int = signal.SIGINT):
    self.step, self.checkpoint_step, self.checkpoint_dir = step, checkpoint_step, checkpoint_dir
    self.signum = signum
    last = (
      (
        f'the last complete checkpoint is step {checkpoint_step} in {checkpoint_dir}; re-run the same '
        'command to resume from it'
      )
      if checkpoint_step is not None
      else 'no checkpoint was written yet'
    )
    super().__init__(f'{signal_name(signum)}: interrupted at step {step}; {last}')


class StopOnInterrupt:
  def __init__(self, grace_s: float = 0.0, on_expiry: Callable[[], None] | None = None):
    self.grace_s, self.on_expiry = float(grace_s), on_expiry
    self.requested = False
    self.signum: int | None = None
    self._previous: dict = {}
    self._wakeup = None
    self._watcher = None
    self._timer = None
    self._noticed = False
    self._notice_lock = threading.Lock()

  def _handle(self, signum, frame):
    del frame
    if self.requested:  # a second signal: stop at once, as without this handler
      raise StopNow(signum)
    self.signum = signum
    self.requested = True
    self._notice(signum)

  def _notice(self, signum: int) -> None:
    """The one line that says the run is stopping, and the grace timer; from whichever of the
    watcher thread and the main thread's handler sees the signal first."""
    with self._notice_lock:
      if self._noticed:
        return
      self._noticed = True
    limit = f' within {self.grace_s:g} s (train.preemption_grace_s)' if self.grace_s > 0 else ''
    print(
      f'\nkimijax: {signal_name(signum)}: stopping after this step, with a checkpoint of it{limit}; '
      'a second signal stops at once',
      file=sys.stderr,
      flush=True,
    )
    if self.grace_s > 0:
      self._timer = threading.Timer(self.grace_s, self._expire, args=(signum,))
      self._timer.daemon = True
      self._timer.start()

  def _expire(self, signum: int) -> None:
    print(
      f'kimijax: {signal_name(signum)}: the step and its checkpoint did not finish within '
      f'train.preemption_grace_s={self.grace_s:g} s; exiting without them (the last complete checkpoint '
      'stays; re-run the same command to resume from it)',
      file=sys.stderr,
      flush=True,
    )
    try:
      if self.on_expiry is not None:
        self.on_expiry()
    finally:
      os._exit(exit_status(signum))

  def _watch(self, reader: socket.socket) -> None:
    """Reads the numbers of the signals as the C-level handler writes them to the wakeup fd."""
    while True:
      try:
        data = reader.recv(64)
      except OSError:
        return
      if not data:
        return
      for signum in data:
        if signum in STOP_SIGNALS:
          self._notice(signum)

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    for signum in STOP_SIGNALS:
      self._previous[signum] = signal.signal(signum, self._handle)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    self._wakeup = (reader, writer, signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False))
    self._watcher = threading.Thread(target=self._watch, args=(reader,), daemon=True, name='kimijax-stop-signals')
    self._watcher.start()
    return self

  def __exit__(self, *exc):
    if self._timer is not None:
      self._timer.cancel()
    for signum, previous in self._previous.items():
      signal.signal(signum, previous)
    self._previous = {}
    if self._wakeup is not None:
      reader, writer, previous_fd = self._wakeup
      signal.set_wakeup_fd(previous_fd)
      writer.close()
      reader.shutdown(socket.SHUT_RDWR)
      reader.close()
      self._watcher.join(timeout=1.0)
      self._wakeup = None
