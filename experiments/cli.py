"""What the workflow scripts share on the command line: one message, no traceback, for a user's
mistake (a bad config key or value, a missing data path, a run folder of another config)."""

from __future__ import annotations

import contextlib
import sys


def list_in_help(*names: str) -> None:
  """Lists the flags `names` (defined in a module the program imports) in the program's --help,
  where absl shows only the flags of the program's own file."""
  from absl import flags

  for name in names:
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])


@contextlib.contextmanager
def user_errors():
  """Turns the errors that name a key or path into `sys.exit('<Type>: <message>')`; quiets absl's
  INFO logs (orbax logs every checkpoint step)."""
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from experiments.runs import WorkflowError
  from kimijax.config import ConfigError
  from kimijax.data import DataError
  from kimijax.train.checkpoint import CheckpointError

  try:
    yield
  except (ConfigError, DataError, CheckpointError, WorkflowError) as e:
    sys.exit(f'{type(e).__name__}: {e}')
