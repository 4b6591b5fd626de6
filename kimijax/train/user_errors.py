"""One line and no traceback for a user's mistake or a stop request: what run.py and the workflow
scripts (experiments/cli.py) share.

    with one_line_errors(UsageError):
      train(config, workdir)

The errors that name the key, path or flag at fault (ConfigError, DataError, CheckpointError,
WorkdirError, NonFiniteError, HfError, and the `extra` types given) end the process with
'<Type>: <message>' and status 1; Interrupted (a stop signal honoured between steps) and
KeyboardInterrupt (a second signal, or Ctrl-C outside training) with a line saying the run resumes
from its last complete checkpoint and the shell's status for the signal (130 for Ctrl-C, 143 for
SIGTERM; kimijax/train/interrupt.py)."""

from __future__ import annotations

import contextlib
import sys


def user_error_types() -> tuple[type[BaseException], ...]:
  """The exception types whose message alone is the report (imported here, when they are needed)."""
  from kimijax.data import DataError
  from kimijax.hf.safetensors import HfError
  from kimijax.schema import ConfigError
  from kimijax.train.checkpoint import CheckpointError
  from kimijax.train.lock import WorkdirError
  from kimijax.train.loop import NonFiniteError

  return ConfigError, DataError, CheckpointError, WorkdirError, NonFiniteError, HfError


@contextlib.contextmanager
def one_line_errors(*extra: type[BaseException]):
  """The block's user errors and stop requests as one line and an exit status (the docstring)."""
  from kimijax.train.interrupt import Interrupted, exit_status

  try:
    yield
  except Interrupted as e:
    print(f'kimijax: {e}', file=sys.stderr, flush=True)
    sys.exit(exit_status(e.signum))
  except KeyboardInterrupt as e:  # a second stop signal (StopNow), or Ctrl-C outside training
    what = str(e) or 'Ctrl-C'
    print(
      f'kimijax: interrupted ({what}); a run resumes from its last complete checkpoint', file=sys.stderr, flush=True
    )
    sys.exit(exit_status(getattr(e, 'signum', 2)))
  except (*user_error_types(), *extra) as e:
    sys.exit(f'{type(e).__name__}: {e}')
