"""Orbax checkpoints of the train state, the data-iterator state and the config.

Saves are asynchronous; orbax writes each step into a temporary folder and renames it when
complete, so a run killed mid-save resumes from the last complete step. A checkpoint that cannot
be read, whose arrays do not match the checksums saved with them (orbax stores raw array bytes
without checksums, so flipped bytes would otherwise load silently), or that was written by a
different model config, stops the run with a message naming the path; it is never overwritten.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from kimijax.config import base_config

# Config groups that must match to restore: they decide parameter shapes and meaning.
# mesh, train and data may change between runs (resharding onto another mesh is supported).
MUST_MATCH = ('model',)
# Keys inside MUST_MATCH that choose how to compute, not what: a checkpoint restores under any of
# their values (e.g. trained with cuDNN attention on a GPU, evaluated with 'xla' on a CPU).
# (model.kernels: the group, every key in it.)
MAY_DIFFER = (
  'model.attn_impl',
  'model.kda_impl',
  'model.short_conv_impl',
  'model.kda_recompute_projections',
  'model.attnres_impl',
  'model.mla_decode_impl',
  'model.moe.impl',
  'model.moe.remat',
  'model.remat',
  'model.kernels',
)
# Keys inside MUST_MATCH that change what the positions mean, on purpose, for a trained model:
# YaRN's context extension is applied to a model trained without it (or with another factor),
# to evaluate it at a longer context or to continue training there (docs/attention.md#yarn).
MAY_EXTEND = ('model.yarn',)


# Saved values from before a key changed its type or its values were renamed, as the key's value
# now, and saved keys that were renamed, as the key now: a config.json written then reads as the
# same config (restore, run folders, --mode=eval).
LEGACY_VALUES = {
  'model.kda_recompute_projections': {False: '', True: 'qkv'},
  'model.kda_impl': {'chunk': 'xla', 'recurrent': 'xla_recurrent'},
}
LEGACY_KEYS = {'model.kda_conv_impl': 'model.short_conv_impl'}


def _current(key: str, value):
  """A saved value of `key` ('group.name') as the schema now spells it."""
  legacy = LEGACY_VALUES.get(key)
  if legacy is not None and isinstance(value, (bool, str)) and value in legacy:
    return legacy[value]
  return value


def _saved_tree(state):
  """The tree a TrainState is saved as: its fields by name, the MoE biases only when the model has
  them, so that a dense model's checkpoints are laid out as they were before the field existed
  (and restore both ways). Other trees are saved as they are."""
  from kimijax.train.state import TrainState

  if not isinstance(state, TrainState):
    return state
  tree = {'step': state.step, 'params': state.params, 'opt_state': state.opt_state}
  if state.moe_state:
    tree['moe_state'] = state.moe_state
  return tree


def _state_from(tree, like):
  """_saved_tree's inverse: a TrainState again when `like` (the abstract state) is one."""
  from kimijax.train.state import TrainState

  if not isinstance(like, TrainState):
    return tree
  return TrainState(
    step=tree['step'], params=tree['params'], opt_state=tree['opt_state'], moe_state=tree.get('moe_state', {})
  )


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be restored into this run."""


UNTOUCHED = 'it was left untouched: move it away or use another --workdir'


def _flatten(d, prefix=''):
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flatten(v, f'{prefix}{k}.'))
    else:
      out[f'{prefix}{k}'] = list(v) if isinstance(v, tuple) else v
  return out


def config_mismatches(saved: dict, config: ml_collections.ConfigDict) -> list[str]:
  """Keys under MUST_MATCH (less MAY_DIFFER and MAY_EXTEND) whose saved value differs from `config`, as
  'key: saved -> now'. A key the saved config lacks (added to the schema after it was written)
  matches its default."""
  keys = set(_flatten(json.loads(config.to_json()))) | {LEGACY_KEYS.get(k, k) for k in _flatten(saved)}
  free = lambda k: any(k == m or k.startswith(m + '.') for m in MAY_DIFFER + MAY_EXTEND)
  keys = sorted(k for k in keys if k.split('.')[0] in MUST_MATCH and not free(k))
  return config_differences(saved, config, keys + list(MUST_MATCH_KEYS))


# Keys outside MUST_MATCH whose change between runs makes the saved state unusable (another
# optimizer has another state tree).
MUST_MATCH_KEYS = ('optimizer.name',)
# Keys that decide the learning-rate schedule: a change on resume is allowed (continuing a run
# for longer is normal) and reported in one line at start-up.
SCHEDULE_KEYS = (
  'train.steps',
  'optimizer.schedule',
  'optimizer.learning_rate',
  'optimizer.warmup_steps',
  'optimizer.decay_fraction',
  'optimizer.min_lr_ratio',
)


def config_differences(saved: dict, config: ml_collections.ConfigDict, keys=None) -> list[str]:
  """'key: saved -> now' for each of `keys` (None: every key of either) whose value differs; a key
  the saved config lacks (added to the schema after it was written) has its default."""
  now = _flatten(json.loads(config.to_json()))
  before = {LEGACY_KEYS.get(k, k): _current(LEGACY_KEYS.get(k, k), v) for k, v in _flatten(saved).items()}
  keys = sorted(set(now) | set(before)) if keys is None else keys
  defaults = _flatten(json.loads(base_config().to_json()))
  return [
    f'{k}: {before.get(k, defaults.get(k))!r} -> {now.get(k)!r}'
    for k in keys
    if before.get(k, defaults.get(k)) != now.get(k)
  ]


def schedule_changes(saved: dict | None, config: ml_collections.ConfigDict) -> list[str]:
  """One line per SCHEDULE_KEYS difference between a checkpoint's config and `config`."""
  if not saved:
    return []
  return [
    f'{d} since the checkpoint (the run continues under the new value; the learning rate '
    'follows the new schedule from the restored step)'
    for d in config_differences(saved, config, SCHEDULE_KEYS)
  ]


def resume_differences(saved: dict | None, config: ml_collections.ConfigDict, since: str = 'the checkpoint'):
  """The one rule for continuing a run under `config`, run.py's resume and the workflows' run
  folders alike: (errors, notices) between `saved`, the config the run was saved with, and
  `config`. A different model (MUST_MATCH less MAY_DIFFER and MAY_EXTEND) or optimizer.name is an error (the
  saved state means something else); any other difference is a notice, the run continuing under
  the new value: the schedule keys (SCHEDULE_KEYS) first, e.g. a longer train.steps, then the rest
  (YaRN's keys among them: MAY_EXTEND)."""
  if not saved:
    return [], []
  errors = config_mismatches(saved, config)
  refused = {e.split(':')[0] for e in errors}
  notices = [
    f'{d} since {since} (the run continues under the new value; the learning rate follows the new '
    'schedule from the restored step)'
    for d in config_differences(saved, config, SCHEDULE_KEYS)
  ]
  notices += [
    f'{d} since {since} (the run continues under the new value)'
    for d in config_differences(saved, config)
    if d.split(':')[0] not in refused and d.split(':')[0] not in SCHEDULE_KEYS
  ]
  return errors, notices


def resume_notices(saved: dict | None, config: ml_collections.ConfigDict) -> list[str]:
  """resume_differences' notices (its errors stop the restore first)."""
  return resume_differences(saved, config)[1]


def _leaf_checksum(x):
  """[2] uint32: sum of the leaf's 32-bit words and sum of word * (2 * index + 1), mod 2**32.
  Integer sums are exact in any order, so the result does not depend on the sharding."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  elif x.dtype.itemsize >= 4:
    words = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{8 * x.dtype.itemsize}')).astype(jnp.uint32)
  words = words.reshape(-1)
  odd = 2 * jnp.arange(words.size, dtype=jnp.uint32) + 1
  return jnp.stack([jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * odd, dtype=jnp.uint32)])


@functools.lru_cache(maxsize=8)
def _checksum_fn(out_sharding):
  return jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree), out_shardings=out_sharding)


def state_checksums(state) -> dict[str, list[int]]:
  """{leaf path: [two uint32 checksums]} of a pytree of jax Arrays."""
  leaves = jax.tree.leaves(state)
  sharding = leaves[0].sharding if leaves else None
  out = NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else None
  sums = jax.device_get(_checksum_fn(out)(state))
  return {
    jax.tree_util.keystr(path): [int(v) for v in value] for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]
  }


def _check_sums(path: pathlib.Path, sums: dict, saved: dict) -> None:
  """CheckpointError naming the arrays whose checksums (state_checksums) are not those saved."""
  bad = sorted(k for k in set(sums) | set(saved) if sums.get(k) != saved.get(k))
  if bad:
    more = f' and {len(bad) - 5} more' if len(bad) > 5 else ''
    raise CheckpointError(
      f'checkpoint {path} is corrupt: the restored arrays {bad[:5]}{more} do not '
      f'match the checksums saved with them; {UNTOUCHED}'
    )


class Checkpointer:
  def __init__(self, directory: str | pathlib.Path, *, keep: int):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=True),
      item_names=('state', 'data', 'config', 'checksums'),
    )
    self.restored_config: dict | None = None  # the config saved with the last restored step

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, data_state: dict, config: ml_collections.ConfigDict) -> None:
    self.manager.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave(_saved_tree(state)),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave(json.loads(config.to_json())),
        checksums=ocp.args.JsonSave(state_checksums(state)),
      ),
    )

  def check_config(self, step: int, config: ml_collections.ConfigDict):
    """The metadata (config, checksums) saved with `step`, read without the state; a CheckpointError
    naming each key when that config's model or optimizer (config_mismatches) is not `config`'s:
    the one check of a resume, made also where a finished run restores nothing."""
    path = self.directory / str(step)
    try:  # orbax raises many exception types for unreadable files
      meta = self.manager.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), checksums=ocp.args.JsonRestore())
      )
    except Exception as e:
      raise CheckpointError(f'checkpoint {path} cannot be read ({type(e).__name__}: {e}); {UNTOUCHED}') from e
    mismatches = config_mismatches(meta.config, config)
    if mismatches:
      raise CheckpointError(
        f'checkpoint {path} was written by a different model or optimizer config; '
        f'{UNTOUCHED}. Differences (saved -> now): ' + '; '.join(mismatches)
      )
    return meta

  def restore(self, step: int, abstract_state, config: ml_collections.ConfigDict):
    """(state laid out as abstract_state's shardings, data-iterator state) of `step`."""
    path = self.directory / str(step)
    meta = self.check_config(step, config)
    self.restored_config = meta.config
    try:
      restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_saved_tree(abstract_state)), data=ocp.args.JsonRestore()
        ),
      )
    except Exception as e:
      raise CheckpointError(f'checkpoint {path} cannot be restored ({type(e).__name__}: {e}); {UNTOUCHED}') from e
    state = _state_from(restored.state, abstract_state)
    _check_sums(path, state_checksums(state), meta.checksums)
    return state, restored.data

  def restore_weights(self, step: int, abstract_state, config: ml_collections.ConfigDict):
    """(params, moe_state) of `step` laid out as abstract_state's shardings, checked like a resume
    (check_config, then the checksums of what is read), without reading the optimizer state: for
    evaluation, generation and train.init_from, which would otherwise hold the optimizer's moments
    (one to two times the parameters' bytes) as well."""
    from kimijax.train.state import TrainState

    path = self.directory / str(step)
    meta = self.check_config(step, config)
    wanted = {k: v for k, v in _saved_tree(abstract_state).items() if k != 'opt_state'}
    try:
      tree = ocp.PyTreeCheckpointer().restore(
        path / 'state',
        args=ocp.args.PyTreeRestore(
          item=wanted, restore_args=ocp.checkpoint_utils.construct_restore_args(wanted), partial_restore=True
        ),
      )
    except Exception as e:
      raise CheckpointError(f'checkpoint {path} cannot be restored ({type(e).__name__}: {e}); {UNTOUCHED}') from e
    moe_state = tree.get('moe_state', {})
    read = TrainState(step=tree['step'], params=tree['params'], opt_state=None, moe_state=moe_state)
    saved = {k: v for k, v in meta.checksums.items() if not k.startswith('.opt_state')}
    _check_sums(path, state_checksums(read), saved)
    return tree['params'], moe_state

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()


def load_run_config(workdir: str | pathlib.Path) -> ml_collections.ConfigDict:
  """A trained run's DIR/config.json laid over base_config() (keys added since keep their
  defaults), validated, with the mesh made data-parallel over this host's devices."""
  from kimijax.config import validate

  path = pathlib.Path(workdir) / 'config.json'
  if not path.exists():
    raise CheckpointError(f'{path} not found: --workdir must be a folder that run.py trained into')
  try:
    saved = json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f'{path} is not readable JSON ({e}); it is the config run.py wrote for DIR') from None
  if not isinstance(saved, dict):
    raise CheckpointError(f'{path} holds a {type(saved).__name__}, not the config (a JSON object) run.py wrote')
  config = base_config()
  for key, value in _flatten(saved).items():
    key_now = LEGACY_KEYS.get(key, key)
    *groups, name = key_now.split('.')
    node = config
    try:
      for group in groups:
        node = node[group]
      known = name in node
    except (KeyError, TypeError):
      known = False
    if not known:
      raise CheckpointError(f'{path}: unknown config key {key!r}; the file is not a config run.py wrote')
    node[name] = tuple(tuple(r) for r in value) if key == 'mesh.rules' else _current(key_now, value)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  return validate(config)


def restore_latest_weights(workdir: str | pathlib.Path, config: ml_collections.ConfigDict, model, mesh):
  """(params, moe_state, step) of the latest checkpoint in DIR/checkpoints laid out on `mesh`,
  checked like a resume, the optimizer state not read (Checkpointer.restore_weights): what
  evaluation, generation (kimijax.model.inference_variables) and train.init_from take."""
  from kimijax.optim import make_optimizer
  from kimijax.train.state import state_shardings

  directory = pathlib.Path(workdir) / 'checkpoints'
  if not directory.is_dir():  # checked first: the checkpoint manager would create the folder
    raise CheckpointError(f'no checkpoint in {directory}: the run has not saved one yet')
  checkpointer = Checkpointer(directory, keep=config.train.keep_checkpoints)
  step = checkpointer.latest_step()
  if step is None:
    raise CheckpointError(f'no checkpoint in {directory}')
  abstract, _ = state_shardings(model, make_optimizer(config), config, mesh)
  try:
    params, moe_state = checkpointer.restore_weights(step, abstract, config)
  finally:
    checkpointer.close()
  return params, moe_state, step


def latest_complete_step(workdir: str | pathlib.Path) -> int | None:
  """The newest complete checkpoint's step in DIR/checkpoints, read without opening (or creating)
  it: orbax names a complete checkpoint by its step and one being written otherwise."""
  directory = pathlib.Path(workdir) / 'checkpoints'
  steps = [int(p.name) for p in directory.iterdir() if p.name.isdigit()] if directory.is_dir() else []
  return max(steps, default=None)


def latest_weights(
  workdir: str | pathlib.Path, config: ml_collections.ConfigDict, model, mesh, param_dtype: str = 'float32'
):
  """(params, moe_state, step) for evaluation and generation: the latest checkpoint in
  DIR/checkpoints, or, while DIR has none and config.train.init_from is set, the weights it names
  (step 0; initial_weights). param_dtype: the matrices' dtype (kimijax.model.inference_params; a
  released folder is read straight into it, a checkpoint is cast after its float32 restore)."""
  from kimijax.model import inference_params

  if config.train.init_from and latest_complete_step(workdir) is None:
    from kimijax.optim import make_optimizer
    from kimijax.train.state import state_shardings

    abstract, _ = state_shardings(model, make_optimizer(config), config, mesh)
    return *initial_weights(config, inference_params(abstract.params, param_dtype), abstract.moe_state), 0
  params, moe_state, step = restore_latest_weights(workdir, config, model, mesh)
  return inference_params(params, param_dtype), moe_state, step


def is_run_folder(folder: str | pathlib.Path) -> bool:
  """Whether `folder` is one that run.py trained into (it holds checkpoints/), not a released one."""
  return (pathlib.Path(folder) / 'checkpoints').is_dir()


def check_init_from(config: ml_collections.ConfigDict) -> None:
  """One error naming train.init_from when it is not a run folder or a released checkpoint folder
  that can be read (its config.json), or when a released folder's config.json gives another model
  than config.model in any key that changes the maths (YaRN aside: MAY_EXTEND), before any
  tensor is read."""
  folder = config.train.init_from
  if not folder:
    return
  if not pathlib.Path(folder).is_dir():
    raise CheckpointError(
      f'train.init_from={folder!r}: no such folder (a folder run.py trained into, or a released '
      'checkpoint folder: docs/released.md)'
    )
  if is_run_folder(folder):
    load_run_config(folder)
    return
  from kimijax.hf.config import read_config
  from kimijax.hf.export import model_differences
  from kimijax.hf.safetensors import HfError

  differences = model_differences(read_config(folder), config.model, ignore=MAY_EXTEND)
  if differences:
    shown = '; '.join(f'{key}: {got!r} -> {want!r}' for key, want, got in differences)
    raise HfError(f'train.init_from={folder}: the model differs from the checkpoint (config.json -> now): {shown}')


def initial_weights(config: ml_collections.ConfigDict, abstract_params, abstract_moe_state) -> tuple:
  """(params, moe_state) laid out as the abstract leaves' shardings say, from config.train.init_from:
  a run folder's latest checkpoint (its model must be this config's but for MAY_DIFFER and
  MAY_EXTEND; its optimizer may differ), or a released checkpoint folder (kimijax.hf.weights).
  A MemoryLimitError, before anything is read, when one device cannot hold its share of the
  parameters (a run folder's restore also holds that run's optimizer state for a moment)."""
  folder = config.train.init_from
  check_init_from(config)
  mesh = jax.tree.leaves(abstract_params)[0].sharding.mesh
  check_fit(folder, abstract_params, mesh)
  if not is_run_folder(folder):
    from kimijax.hf.weights import load_sharded

    return load_sharded(folder, config.model, abstract_params, abstract_moe_state)
  from kimijax import config as config_lib
  from kimijax.model import Transformer

  source = load_run_config(folder)
  errors = [e for e in config_mismatches(json.loads(source.to_json()), config) if e.startswith('model.')]
  if errors:
    differences = '; '.join(errors)
    raise CheckpointError(f'train.init_from={folder}: its model differs from this config (saved -> now): {differences}')
  source.mesh = config.mesh  # its state laid out on this run's mesh
  params, moe_state, _ = restore_latest_weights(folder, source, Transformer(config_lib.portable(source.model)), mesh)
  place = lambda tree, abstract: jax.tree.map(
    lambda x, a: jax.device_put(x, a.sharding).astype(a.dtype), tree, abstract
  )
  return place(params, abstract_params), place(moe_state, abstract_moe_state)


def check_fit(folder: str, abstract_params, mesh) -> None:
  """MemoryLimitError when one device's share of the parameters (laid out and typed as
  `abstract_params` says) exceeds its memory."""
  from kimijax.train.memory import GiB, MemoryLimitError, device_memory

  limit = device_memory(mesh.devices.flat)
  leaves = jax.tree.leaves(abstract_params)
  per_device = sum(a.dtype.itemsize * math.prod(a.sharding.shard_shape(a.shape)) for a in leaves)
  if limit is not None and per_device > limit[0]:
    raise MemoryLimitError(
      f'the parameters of {folder} take {per_device / GiB:.1f} GiB on each device '
      f'(mesh {dict(mesh.shape)}), more than {limit[1]}'
    )
