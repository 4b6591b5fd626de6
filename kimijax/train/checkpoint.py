"""Orbax checkpoints of the train state, the data-iterator state and the config.

Saves are asynchronous; orbax writes each step into a temporary folder and renames it when
complete, so a run killed mid-save resumes from the last complete step. A checkpoint that cannot
be read, or that was written by a different model config, stops the run with a message naming
the path; it is never overwritten.
"""

from __future__ import annotations

import json
import pathlib

import ml_collections
import orbax.checkpoint as ocp

# Config groups that must match to restore: they decide parameter shapes and meaning.
# mesh, train and data may change between runs (resharding onto another mesh is supported).
MUST_MATCH = ('model',)


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be restored into this run."""


def _flatten(d, prefix=''):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = list(v) if isinstance(v, tuple) else v
  return out


def config_mismatches(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """Keys under MUST_MATCH whose saved value differs from `config`, as 'key: saved -> now'."""
  now = _flatten(json.loads(config.to_json()))
  before = _flatten(saved)
  keys = sorted(k for k in set(now) | set(before) if k.split('.')[0] in MUST_MATCH)
  return [f'{k}: {before.get(k)!r} -> {now.get(k)!r}' for k in keys if before.get(k) != now.get(k)]


class Checkpointer:
  def __init__(self, directory: str | pathlib.Path, *, keep: int):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=True),
        item_names=('state', 'data', 'config'))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, config: ml_collections.ConfigDict) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(json.loads(config.to_json()))))

  def restore(self, step: int, abstract_state, config: ml_collections.ConfigDict):
    """(state laid out as abstract_state's shardings, data-iterator state) of `step`."""
    path = self.directory / str(step)
    try:
      saved_config = self.manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore())).config
    except Exception as e:  # orbax raises many types for unreadable files
      raise CheckpointError(f'checkpoint {path} cannot be read ({type(e).__name__}: {e}); '
                            'it was left untouched: move it away or use another --workdir') from e
    mismatches = config_mismatches(saved_config, config)
    if mismatches:
      raise CheckpointError(f'checkpoint {path} was written by a different model config; it was left '
                            'untouched. Differences (saved -> now): ' + '; '.join(mismatches))
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    except Exception as e:
      raise CheckpointError(f'checkpoint {path} cannot be restored ({type(e).__name__}: {e}); '
                            'it was left untouched: move it away or use another --workdir') from e
    return restored.state, restored.data

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()
