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
and TensorBoard are left as training wrote them. Weights or an eval step (train.batch_size x
train.seq_len) that cannot fit the devices' memory stop first, from shapes alone (check_memory).
"""

from __future__ import annotations

import json
import pathlib
import time

import jax

from kimijax import config as config_lib
from kimijax.data import eval_batches
from kimijax.data.tokenizer import config_vocab_size
from kimijax.model import Transformer, inference_params, inference_variables
from kimijax.parallel import mesh as mesh_lib
from kimijax.train import memory as memory_lib
from kimijax.train.checkpoint import check_fit, latest_complete_step, latest_weights, load_run_config
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
  # Data-parallel over as many of this host's devices as divide the batch (the run may have
  # trained on another number of devices).
  devices = jax.devices()
  count = max(n for n in range(1, len(devices) + 1) if config.train.batch_size % n == 0)
  mesh = mesh_lib.make_mesh(config.mesh, devices[:count])
  model = Transformer(config.model)
  sharding = mesh_lib.batch_sharding(mesh, config.mesh)
  eval_step = in_mesh(jax.jit(make_eval_step(model, config.train.loss_chunk)), mesh, config.mesh)
  check_memory(workdir, config, model, mesh, eval_step, param_dtype)  # before any data, weights or compile
  batches = eval_batches(config, num_batches)  # fails on bad data before the restore
  params, moe_state, step = latest_weights(workdir, config, model, mesh, param_dtype)
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


def check_memory(workdir, config, model, mesh, eval_step, param_dtype: str = 'float32') -> None:
  """MemoryLimitError where the weights as held (param_dtype), naming the folder they come from
  (kimijax.train.checkpoint.check_fit), or the eval step at config.train's batch_size x seq_len,
  naming those keys (kimijax.train.memory.check_eval), cannot fit the devices' memory: from shapes
  alone, before anything is read or compiled. On a GPU, XLA's plan of the step settles an estimate
  over the limit; a plan that fits is said in one line."""
  from kimijax.optim import make_optimizer
  from kimijax.train.state import state_shardings

  abstract, _ = state_shardings(model, make_optimizer(config), config, mesh)
  params = inference_params(abstract.params, param_dtype)
  from_init = config.train.init_from and latest_complete_step(workdir) is None
  check_fit(config.train.init_from if from_init else str(workdir), params, mesh)
  param_bytes = sum(a.dtype.itemsize * a.size for a in jax.tree.leaves(params))
  weights = inference_variables(params, abstract.moe_state)
  batch_sharding = mesh_lib.batch_sharding(mesh, config.mesh)
  plan = lambda: memory_lib.compiled_eval_peak_bytes(eval_step, weights, config, batch_sharding)
  note = memory_lib.check_eval(config, list(mesh.devices.flat), param_bytes, dict(mesh.shape), plan=plan)
  if note and jax.process_index() == 0:
    print(f'kimijax: {note}', flush=True)
