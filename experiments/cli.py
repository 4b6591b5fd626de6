"""What the workflow scripts share on the command line: one message, no traceback, for a user's
mistake (a bad config key or value, a missing data path, a run folder of another config) or a stop
request."""

from __future__ import annotations

import contextlib
import sys
from typing import NoReturn


def list_in_help(*names: str) -> None:
  """Lists the flags `names` (defined in a module the program imports) in the program's --help,
  where absl shows only the flags of the program's own file."""
  from absl import flags

  for name in names:
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


def usage_error(message: str) -> NoReturn:
  """Ends a tool whose flags cannot be used with one line naming the flag (where absl's
  app.UsageError would print the whole module docstring before it)."""
  sys.exit(f'UsageError: {message}')


@contextlib.contextmanager
def user_errors():
  """A user's mistake as one line and no traceback, a stop request as the run's exit status, as in
  run.py (kimijax/train/user_errors.py; here with WorkflowError too); quiets absl's INFO logs
  (orbax logs every checkpoint step)."""
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from experiments.runs import WorkflowError
  from kimijax.train.user_errors import one_line_errors

  with one_line_errors(WorkflowError):
    yield
