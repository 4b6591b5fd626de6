"""The training loop: config -> data + model + optimizer -> jitted steps -> metrics and checkpoints."""

from __future__ import annotations

import pathlib
import shutil
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
import tqdm

from kimijax import config as config_lib
from kimijax.data import data_report, eval_batches, make_loader
from kimijax.model import Transformer, count_params, inference_variables
from kimijax.ops import attention as attention_ops, moe as moe_ops
from kimijax.optim import describe as describe_optimizer, routing_summary
from kimijax.parallel import mesh as mesh_lib
from kimijax.train import (
  checkpoint as ckpt_lib,
  flops as flops_lib,
  lock as lock_lib,
  memory as memory_lib,
  metrics as metrics_lib,
)
from kimijax.train.interrupt import Interrupted, StopOnInterrupt
from kimijax.train.step import build_training, computes_max_logits

# The Muon routing table (each parameter's rule and matrix view), written into the run folder.
ROUTING_FILE = 'optimizer_routing.txt'


class NonFiniteError(FloatingPointError):
  """Loss or gradients became NaN or Inf."""


def _to_global(batch: dict, sharding) -> dict:
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in batch.items()}


def _train_record(step: int, m: dict) -> dict:
  record = {'step': step, 'loss': float(m['loss']), 'lr': float(m['lr']), 'grad_norm': float(m['grad_norm'])}
  per_layer = {name: float(np.max(v)) for name, v in m.get('max_logits', {}).items()}  # {'layer_<i>': [H]}
  if per_layer:
    record['max_logit'] = max(per_layer.values())
    record.update({f'max_logit_{name}': value for name, value in per_layer.items()})
  if 'qk_clip_heads' in m:  # muonclip: query heads whose max logit exceeded tau this step
    record['qk_clip_heads'] = int(m['qk_clip_heads'])
  record.update({k: float(v) for k, v in m.items() if k.startswith('update_rms_')})
  if 'moe' in m:  # MoE layers: loads, router entropy, bias range, balance loss (metrics_lib.MOE_KEYS)
    record.update(metrics_lib.moe_record(jax.device_get(m['moe']), m['moe_aux_loss']))
  if 'attnres' in m:  # train.log_attnres; see kimijax.model for the meaning of each array
    stats = jax.device_get(m['attnres'])
    record['attnres_input_rms'] = [float(x) for x in stats['input_rms']]
    record['attnres_output_rms'] = [float(x) for x in stats['output_rms']]
    if 'weights' in stats:  # one row per consumer, only the sources it sees (no NaN padding)
      record['attnres_weights'] = [[float(x) for x in row if not np.isnan(x)] for row in stats['weights']]
  return record


def check_attention_impl(config: ml_collections.ConfigDict, devices=None) -> None:
  """ConfigError when the attention layers' implementation cannot run on `devices` (default: all)
  with the model's compute dtype (a GPU implementation off the GPU or in float32): one message
  naming model.attn_impl, before anything compiles. Off the GPU it suggests model.attn_impl='xla'
  only where the step would then fit this machine's memory (kimijax.train.memory)."""
  if 'A' not in config_lib.layer_kinds(config.model):
    return
  devices = list(devices or jax.devices())
  platform = devices[0].platform
  impl = config.model.attn_impl
  problem = attention_ops.unsupported(impl, config.model.compute_dtype, platform)
  if not problem:
    return
  if platform != 'gpu' and attention_ops.unsupported(impl, 'bfloat16', platform):  # the platform, not the dtype
    portable = config.copy_and_resolve_references()
    portable.model = config_lib.portable(config.model)
    try:
      memory_lib.check(
        portable, devices, flops_lib.count(flops_lib.abstract_params(config)), _mesh_sizes(config, devices)
      )
      advice = "use model.attn_impl='xla' off the GPU"
    except memory_lib.MemoryLimitError as e:
      advice = f"with model.attn_impl='xla' {e}"
    problem = f'attention impl={impl!r} needs an NVIDIA GPU, but JAX runs on {platform!r} here; {advice}'
  raise config_lib.ConfigError(problem)


def _mesh_sizes(config: ml_collections.ConfigDict, devices) -> dict[str, int]:
  """{'data', 'fsdp', 'tensor'} sizes of the mesh config.mesh makes of `devices`."""
  devices = list(devices)
  return dict(zip(mesh_lib.mesh_axes(config.mesh), mesh_lib.mesh_shape(config.mesh, len(devices), devices[0].platform)))


def _build(config: ml_collections.ConfigDict, mesh):
  """The run's train and eval steps (kimijax.train.step.build_training) for the model it trains."""
  model = Transformer(config.model, log_attnres=config.train.log_attnres, max_logits=computes_max_logits(config))
  return build_training(config, mesh, model)


def check_memory(config: ml_collections.ConfigDict, devices=None) -> str | None:
  """MemoryLimitError, naming the batch, the sequence length and the estimate, when the train step
  would not fit the devices' memory (kimijax.train.memory); before any step runs. On a GPU an
  estimate over the limit is checked against XLA's plan of the compiled step, which decides; the
  line saying so is returned (None when the estimate fits)."""
  devices = list(devices or jax.devices())
  n_params = flops_lib.count(flops_lib.abstract_params(config))
  plan = lambda: memory_lib.compiled_peak_bytes(_build(config, mesh_lib.make_mesh(config.mesh, devices)), config)
  return memory_lib.check(config, devices, n_params, _mesh_sizes(config, devices), plan=plan)


def check_moe_impl(config: ml_collections.ConfigDict, devices=None) -> None:
  """ConfigError naming model.moe.impl when the MoE layers' grouped matmul cannot run on `devices`
  (default: all), e.g. 'tokamax' off a GPU, before anything compiles."""
  m = config.model
  if m.mlp_kind != 'moe':
    return
  platform = (devices or jax.devices())[0].platform
  problem = moe_ops.unsupported(m.moe.impl, m.compute_dtype, m.d_model, config_lib.moe_hidden(m)[0], platform)
  if problem:
    raise config_lib.ConfigError(problem.replace(f'moe impl={m.moe.impl!r}', f'model.moe.impl={m.moe.impl!r}'))


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
  """[first, last] 0-based positions of each bucket of the eval loss by position: position p sees
  p + 1 tokens of context, and bucket k holds the positions with p + 1 in [2^k, 2^(k+1)), so that
  the buckets are evenly spaced on a log axis of context length. A last bucket cut to less than
  half its width by seq_len joins the one before it."""
  buckets, start = [], 0
  while start < seq_len:
    end = min(2 * start, seq_len - 1)
    if buckets and end - start + 1 < (2 * start - start + 1) / 2:
      buckets[-1] = (buckets[-1][0], end)
    else:
      buckets.append((start, end))
    start = end + 1
  return buckets


def evaluate_details(eval_step, params, batches: list[dict]) -> dict:
  """Over the fixed validation batches: 'eval_loss' (mean token nll), 'accuracy' (fraction of
  masked tokens predicted exactly by argmax), 'position_buckets' and 'loss_by_position' (mean nll
  per bucket of position_buckets; None for a bucket without masked tokens)."""
  sums = None
  for batch in batches:
    out = jax.device_get(eval_step(params, batch))
    sums = out if sums is None else jax.tree.map(np.add, sums, out)
  count = max(float(sums['tokens']), 1.0)
  nll_p, tok_p = np.asarray(sums['nll_by_position'], np.float64), np.asarray(sums['tokens_by_position'], np.float64)
  buckets = position_buckets(len(tok_p))
  by_position = []
  for first, last in buckets:
    n = tok_p[first : last + 1].sum()
    by_position.append(float(nll_p[first : last + 1].sum() / n) if n > 0 else None)
  return {
    'eval_loss': float(sums['nll']) / count,
    'accuracy': float(sums['correct']) / count,
    'position_buckets': [list(b) for b in buckets],
    'loss_by_position': by_position,
  }


def _final_losses(workdir: pathlib.Path, upto: int) -> tuple[float | None, float | None]:
  """(last train loss, last eval loss) logged at or before step `upto`, from metrics.jsonl."""
  if not (workdir / 'metrics.jsonl').exists():
    return None, None
  records = [r for r in metrics_lib.read_metrics(workdir) if r.get('step', 0) <= upto]
  last = lambda key: next((r[key] for r in reversed(records) if key in r), None)
  return last('loss'), last('eval_loss')


def summary_text(summary: dict) -> str:
  """run.py's summary of a finished train(): this run's steps, tokens, time and rate, and with a resume
  the run's total."""
  start, steps, seconds = summary.get('start_step', 0), summary['steps'], summary['seconds']
  run_tokens = summary.get('run_tokens', summary['tokens'])
  lines = [
    'done.',
    f'  parameters   {summary["params"] / 1e6:.2f}M',
    f'  this run     steps {start + 1}-{steps}: {run_tokens:,} tokens in {seconds:.0f} s, '
    f'{run_tokens / max(seconds, 1e-9):,.0f} tokens/s (compilation and evals included)',
  ]
  if start:
    lines.append(f'  in all       {steps} steps, {summary["tokens"]:,} tokens (resumed from step {start})')
  lines += [
    f'  final loss   train {_fmt_loss(summary["final_loss"])}, eval {_fmt_loss(summary["eval_loss"])} (nats/token)',
    f'  outputs      {summary["workdir"]}/ (metrics.jsonl, checkpoints/, tensorboard/, loss.png)',
  ]
  return '\n'.join(lines)


def _fmt_loss(x) -> str:
  return 'n/a' if x is None else f'{x:.4f}'


def run_title(workdir: pathlib.Path, n_params: int, tokens: int) -> str:
  """The loss plot's title: the run's name, its parameters and tokens trained."""
  return f'{workdir.absolute().name}: {n_params / 1e6:.2f}M parameters, {tokens:,} tokens'


def _remove_created(workdir: pathlib.Path, before: set[str], created: bool) -> None:
  """Removes the entries of workdir that are not in `before` (taken under this run's lock), and
  workdir itself if this run `created` it and it is then empty."""
  for path in workdir.iterdir() if workdir.is_dir() else []:
    if path.name not in before and path.name != lock_lib.LOCK_NAME:
      shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
  if created and workdir.is_dir() and not [p for p in workdir.iterdir() if p.name != lock_lib.LOCK_NAME]:
    (workdir / lock_lib.LOCK_NAME).unlink(missing_ok=True)
    workdir.rmdir()


def train(config: ml_collections.ConfigDict, workdir: str | pathlib.Path, *, devices=None) -> dict:
  """Trains (or resumes) `config` in `workdir` on `devices` (default: all); returns a summary.

  Process 0 holds a lock on the workdir for the run's life (kimijax.train.lock). A run whose
  checkpoint already reached train.steps writes nothing and returns summary['already_finished'] (a
  CheckpointError naming the keys where config's model or optimizer is not the checkpoint's, as on resume).
  A stop signal (Ctrl-C, SIGTERM, SIGUSR1: kimijax.train.interrupt) stops after the current step,
  saves a checkpoint of it within train.preemption_grace_s and raises Interrupted. A train step that
  would not fit the devices' memory stops before any step runs (kimijax.train.memory). A run
  that stops before its first step completes removes what it created in workdir, so that a re-run
  finds the folder as it was."""
  config_lib.validate(config)
  workdir = pathlib.Path(workdir)
  pid, nproc = jax.process_index(), jax.process_count()
  t = config.train

  # Everything that can fail on bad input is checked before any compile or step.
  lock_lib.check_workdir(workdir)
  check_attention_impl(config, devices)
  check_moe_impl(config, devices)
  saved = ckpt_lib.latest_complete_step(workdir)
  if (saved or 0) < t.steps:  # a finished run only reports
    note = check_memory(config, devices)
    if note and pid == 0:
      print(f'kimijax: {note}', flush=True)
  if saved is None:  # a fresh run reads train.init_from, if set
    ckpt_lib.check_init_from(config)
  train_loader = make_loader(config, 'train', process_index=pid, process_count=nproc)
  if config.model.vocab_size < train_loader.vocab_size:
    raise config_lib.ConfigError(
      f'model.vocab_size={config.model.vocab_size} is smaller than the tokenizer vocabulary ({train_loader.vocab_size})'
    )
  val_local = eval_batches(config, t.eval_batches, process_index=pid, process_count=nproc)
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  created = not workdir.exists()
  lock = lock_lib.WorkdirLock(workdir, ' '.join(sys.argv)) if pid == 0 else None
  if lock is not None:
    lock.acquire()
  before = {p.name for p in workdir.iterdir()} if workdir.is_dir() else set()  # under the lock
  progress = {'first_step': False}  # set once a step has completed (and config.json is written)
  try:
    with StopOnInterrupt(t.preemption_grace_s, on_expiry=lock.release if lock is not None else None) as stop:
      return _train_locked(config, workdir, mesh, train_loader, val_local, stop, progress)
  except BaseException:
    if pid == 0 and not progress['first_step']:
      _remove_created(workdir, before, created)
    raise
  finally:
    if lock is not None:
      lock.release()


def first_step(train_step, state, batch, config, mesh):
  """The first train step (it compiles), waited for, with XLA's out-of-memory error as one
  MemoryLimitError: on a GPU the step's buffers may fail to allocate only once it runs, after the
  asynchronous call has returned."""
  try:
    return jax.block_until_ready(train_step(state, batch))
  except jax.errors.JaxRuntimeError as e:
    text = str(e)
    if 'RESOURCE_EXHAUSTED' not in text and 'out of memory' not in text.lower():
      raise
    n_params = flops_lib.count(flops_lib.abstract_params(config))
    devices = list(mesh.devices.flat)
    estimate = memory_lib.describe(config, memory_lib.estimate(config, n_params), _mesh_sizes(config, devices))
    first = text.strip().splitlines()[0][:200]
    remedies = ', or '.join(memory_lib.untried_remedies(config, devices))
    raise memory_lib.MemoryLimitError(
      f'out of memory in the first train step; {estimate}; {remedies} (XLA: {first})'
    ) from None


def _train_locked(config, workdir: pathlib.Path, mesh, train_loader, val_local, stop, progress) -> dict:
  pid, t = jax.process_index(), config.train
  tokens_per_step = t.batch_size * t.seq_len
  checkpointer = ckpt_lib.Checkpointer(workdir / 'checkpoints', keep=t.keep_checkpoints)
  start = checkpointer.latest_step()
  if start is not None and start >= t.steps:  # a re-run of a finished run: report, write nothing
    try:  # under another model or optimizer it is refused as a resume is, naming the keys
      checkpointer.check_config(start, config)
    finally:
      checkpointer.close()
    final_loss, eval_loss = _final_losses(workdir, start)
    return {
      'already_finished': True,
      'steps': start,
      'final_loss': final_loss,
      'eval_loss': eval_loss,
      'tokens': start * tokens_per_step,
      'workdir': str(workdir.absolute()),
    }

  run = _build(config, mesh)
  abstract_state, train_step, eval_step = run.abstract_state, run.train_step, run.eval_step
  notices = []
  if start is not None:
    state, data_state = checkpointer.restore(start, abstract_state, config)
    train_loader.set_state(data_state)
    notices = ckpt_lib.resume_notices(checkpointer.restored_config, config)
  else:
    start = 0
    state = run.init_state(config)

  batch_sharding = run.batch_sharding
  val_batches = [_to_global(b, batch_sharding) for b in val_local]
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start if start else None)
  n_params = count_params(state.params)
  inactive = config_lib.moe_inactive_params(config.model)  # MoE: routed experts a token does not use
  if pid == 0:
    print(
      f'kimijax: {n_params / 1e6:.2f}M parameters'
      + (f' ({(n_params - inactive) / 1e6:.2f}M active)' if inactive else '')
      + f', mesh {dict(mesh.shape)}, '
      f'{tokens_per_step} tokens/step, {"resuming from step " + str(start) if start else "fresh start"}',
      flush=True,
    )
    print('\n'.join(data_report(config)), flush=True)
    for notice in notices:
      print(f'notice: {notice}', flush=True)
    routing_table = describe_optimizer(config, abstract_state.params)
    if routing_table:  # the whole table in the run folder; on the terminal one line unless asked
      routing_file = workdir / ROUTING_FILE
      routing_file.write_text(routing_table + '\n')
      if t.print_routing:
        print(f'optimizer {config.optimizer.name}: parameter routing\n{routing_table}', flush=True)
      else:
        print(
          f'optimizer {config.optimizer.name}: {routing_summary(config, abstract_state.params)}; '
          f'each parameter: {routing_file} (train.print_routing=True prints it)',
          flush=True,
        )

  def check(step: int, metrics: dict) -> None:
    if not bool(metrics['finite']):
      checkpointer.wait()
      last = checkpointer.latest_step()
      kept = f'The last good checkpoint is step {last} in' if last is not None else 'No checkpoint was saved yet in'
      raise NonFiniteError(f'loss or gradients became NaN/Inf at step {step}; stopped. {kept} {checkpointer.directory}')

  # On MQAR the masked targets are the queried values, so the accuracy is the recall accuracy.
  accuracy_key = 'eval_recall_accuracy' if config.data.source == 'mqar' else 'eval_accuracy'
  bar = tqdm.tqdm(total=t.steps, initial=start, disable=pid != 0, dynamic_ncols=True, desc='train')
  started = time.time()
  interval_start, interval_steps = None, 0
  last_loss, eval_loss, pending = None, None, None
  stopped_at = start if stop.requested else None
  try:
    for step in range(start + 1, t.steps + 1):
      if stopped_at is not None:
        break
      batch = _to_global(next(train_loader), batch_sharding)
      if interval_start is None:
        state, metrics = first_step(train_step, state, batch, config, mesh)
      else:
        state, metrics = train_step(state, batch)
      if pending is not None:
        check(*pending)  # one step behind, so the host does not stall the device
      pending = (step, metrics)
      if interval_start is None:  # the first step includes compilation: time from after it
        check(*pending)
        interval_start = time.time()
        if pid == 0:  # written once a step has run: a run that never got here leaves no config behind
          (workdir / 'config.json').write_text(config.to_json(indent=2))
        progress['first_step'] = True
      else:
        interval_steps += 1
      last = step == t.steps
      if step % t.log_every == 0 or last or step == 1:  # step 1: the first loss (~ln vocab)
        check(*pending)
        record = _train_record(step, metrics)
        now = time.time()
        rate = interval_steps * tokens_per_step / max(now - interval_start, 1e-9) if interval_steps else 0.0
        interval_start, interval_steps = now, 0
        record.update(tokens=step * tokens_per_step, tokens_per_sec=rate)
        writer.write(record)
        last_loss = record['loss']
        bar.set_postfix(loss=f'{last_loss:.3f}', tok_s=f'{rate:,.0f}', refresh=False)
      if step % t.eval_every == 0 or last:
        details = evaluate_details(eval_step, inference_variables(state.params, state.moe_state), val_batches)
        eval_loss = details['eval_loss']
        writer.write(
          {
            'step': step,
            'eval_loss': eval_loss,
            accuracy_key: details['accuracy'],
            'eval_position_buckets': details['position_buckets'],
            'eval_loss_by_position': details['loss_by_position'],
            'tokens': step * tokens_per_step,
          }
        )
        if pid == 0:
          bar.write(f'step {step}: eval loss {eval_loss:.4f}')
      stopping = stop.requested  # read once: a signal from here on stops after the next step
      if step % t.checkpoint_every == 0 or last or stopping:
        check(*pending)  # a stop signal saves the step it stopped after: no step is lost
        checkpointer.save(step, state, train_loader.get_state(), config)
      bar.update(1)
      if stopping:
        stopped_at = step
  finally:
    bar.close()
    checkpointer.wait()
    writer.close()
  if stopped_at is not None:
    latest = checkpointer.latest_step()
    checkpointer.close()
    raise Interrupted(stopped_at, latest, checkpointer.directory, stop.signum or signal.SIGINT)
  checkpointer.close()

  seconds = time.time() - started
  summary = {
    'params': n_params,
    **({'active_params': n_params - inactive} if inactive else {}),
    'steps': t.steps,
    'tokens': t.steps * tokens_per_step,
    'start_step': start,  # this run trained steps start + 1 .. steps
    'run_tokens': (t.steps - start) * tokens_per_step,
    'seconds': seconds,  # this run's, from its first step (compilation and evals included)
    'final_loss': last_loss,
    'eval_loss': eval_loss,
    'workdir': str(workdir.absolute()),
  }
  if pid == 0 and t.plot and (workdir / 'metrics.jsonl').exists():
    summary['plot'] = str(metrics_lib.plot_loss_curve(workdir, run_title(workdir, n_params, summary['tokens'])))
    summary['plot_by_position'] = str(metrics_lib.plot_loss_by_position(workdir))
  return summary
