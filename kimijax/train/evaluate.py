"""--mode=eval: the latest checkpoint of a run on its validation split, printed and logged.

    result = evaluate_run('runs/default')   # {'step', 'eval_loss', 'loss_by_position', ...}
    result = evaluate_run('runs/default', config=load('configs/trained.py:runs/default',
                          overrides={'train.seq_len': 8192, 'model.yarn.factor': 4.0}))

The run's config.json decides the data and model, or `config` (the run's own with keys changed:
configs/trained.py; a released folder's: configs/released.py), whose model must restore the
checkpoint (kimijax.train.checkpoint.MUST_MATCH; YaRN may change, as for a context extension). The
mesh is data-parallel over this host's devices (and off a GPU the implementations become
kimijax.config.portable's, as for generation). Each call appends one line to DIR/eval.jsonl, with
the loss by position bucket (kimijax.train.loop.position_buckets); metrics.jsonl, the checkpoints
and TensorBoard are left as training wrote them.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax

from kimijax import config as config_lib
from kimijax.data import eval_batches
from kimijax.data.tokenizer import config_vocab_size
from kimijax.model import Transformer, inference_variables
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.checkpoint import latest_weights, load_run_config
from kimijax.train.loop import evaluate_details
from kimijax.train.step import in_mesh, make_eval_step


def evaluate_run(
  workdir: str | pathlib.Path, num_batches: int | None = None, config=None, param_dtype: str = 'float32'
) -> dict:
  """Mean validation nll of the latest checkpoint in `workdir` over `num_batches` batches
  (default: the run's train.eval_batches). `config` in place of the run's config.json: then a
  released checkpoint named by its train.init_from stands in while workdir has no checkpoint."""
  workdir = pathlib.Path(workdir)
  config = load_run_config(workdir) if config is None else config.copy_and_resolve_references()
  if jax.default_backend() != 'gpu':
    config.model = config_lib.portable(config.model)
  num_batches = num_batches or config.train.eval_batches
  config_vocab_size(config)  # a tokenizer with ids past the model's vocabulary is a DataError naming both
  batches = eval_batches(config, num_batches)  # fails on bad data before the restore
  # Data-parallel over as many of this host's devices as divide the batch (the run may have
  # trained on another number of devices).
  devices = jax.devices()
  count = max(n for n in range(1, len(devices) + 1) if config.train.batch_size % n == 0)
  mesh = mesh_lib.make_mesh(config.mesh, devices[:count])
  model = Transformer(config.model)
  params, moe_state, step = latest_weights(workdir, config, model, mesh, param_dtype)
  sharding = mesh_lib.batch_sharding(mesh, config.mesh)
  eval_step = in_mesh(jax.jit(make_eval_step(model, config.train.loss_chunk)), mesh, config.mesh)
  batches = [{k: jax.device_put(v, sharding) for k, v in b.items()} for b in batches]
  details = evaluate_details(eval_step, inference_variables(params, moe_state), batches)
  result = {
    'step': step,
    'eval_loss': details['eval_loss'],
    'eval_batches': num_batches,
    'tokens': int(sum(float(b['mask'].sum()) for b in batches)),
    'seq_len': config.train.seq_len,
    'yarn_factor': config.model.yarn.factor,
    'param_dtype': param_dtype,
    'accuracy': details['accuracy'],
    'position_buckets': details['position_buckets'],
    'loss_by_position': details['loss_by_position'],
    'time': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
  }
  workdir.mkdir(parents=True, exist_ok=True)
  with (workdir / 'eval.jsonl').open('a') as f:
    f.write(json.dumps(result) + '\n')
  return result
