"""Ctrl-C (SIGINT) as a request to stop between steps, so no step or checkpoint save is torn.

    with StopOnInterrupt() as stop:
      for step in ...:
        ...
        if stop.requested:
          break

Inside the block the first SIGINT only sets `requested` (and says so); the loop then finishes
the step, waits for the pending checkpoint save and raises Interrupted, which run.py turns into a
message and exit status 130. A second SIGINT raises KeyboardInterrupt at once (the last complete
checkpoint stays; orbax never exposes a half-written one).
Outside the main thread (where signal handlers cannot be set) the
block does nothing and SIGINT keeps its usual meaning.
"""

from __future__ import annotations

import signal
import sys
import threading


class Interrupted(Exception):
  """Training stopped on SIGINT; carries the step reached and the last complete checkpoint."""

  def __init__(self, step: int, checkpoint_step: int | None, checkpoint_dir):
    self.step, self.checkpoint_step, self.checkpoint_dir = step, checkpoint_step, checkpoint_dir
    last = (
      (
        f'the last complete checkpoint is step {checkpoint_step} in {checkpoint_dir}; re-run the same '
        'command to resume from it'
      )
      if checkpoint_step is not None
      else 'no checkpoint was written yet'
    )
    super().__init__(f'interrupted at step {step}; {last}')


class StopOnInterrupt:
  def __init__(self):
    self.requested = False
    self._previous = None

  def _handle(self, signum, frame):
    del signum, frame
    if self.requested:  # a second Ctrl-C: stop at once, as without this handler
      raise KeyboardInterrupt
    print(
      '\nkimijax: Ctrl-C: stopping after this step (and any checkpoint save in progress); Ctrl-C again stops at once',
      file=sys.stderr,
      flush=True,
    )
    self.requested = True

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None
