"""A trained run's own config (DIR/config.json), so that its checkpoint is evaluated or generated
from with some keys changed: a longer context, YaRN's context extension, other data; or, with
--config.train.init_from=DIR and a new --workdir, continued as a new run (docs/training.md).

Run:      python run.py --mode=eval --config=configs/trained.py:DIR --workdir=DIR \
              --config.train.seq_len=4096 --config.model.yarn.factor=4 --config.model.yarn.original_context=1024
          python run.py --mode=generate --config=configs/trained.py:DIR --workdir=DIR --prompt='...' \
              --config.model.yarn.factor=4
Variants: DIR only (the run folder that run.py trained into).
Expected: DIR's latest checkpoint under the changed keys; the model keys that decide its parameters
          and their meaning must match the run's (kimijax/train/checkpoint.py MUST_MATCH), YaRN
          aside (docs/attention.md#yarn). --mode=eval appends to DIR/eval.jsonl the loss and the
          loss by position at the new context: how the model extrapolates past the length it was
          trained at, with or without YaRN.
"""

from kimijax.config import ConfigError

VARIANTS = {}


def get_config(arg: str | None = None):
  if not arg or ',' in arg:
    raise ConfigError('give the run folder, and nothing after it: --config=configs/trained.py:DIR')
  from kimijax.train.checkpoint import CheckpointError, load_run_config

  try:
    return load_run_config(arg)
  except CheckpointError as e:
    raise ConfigError(str(e)) from None
