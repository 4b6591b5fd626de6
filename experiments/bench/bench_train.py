"""Training throughput: tokens/s, step time, model FLOPs utilisation and peak memory.

    python -m experiments.bench.bench_train --config=configs/bench_350m.py [--config.a.b=v] [--steps=20]

Runs the real jitted train step (same code as run.py) on synthetic token batches, after warm-up,
and prints the benchmarks' header line (experiments/runs.py print_header), then one line per
figure: device, params_M, step_ms, tokens_per_sec, model_tflops_per_device, mfu, peak_memory_GiB,
loss, init_s (creating the train state), first_step_s (the first step with its compilation or cache
load), ... With --documents=MIN,MAX each row packs documents of MIN to MAX
tokens (kimijax.data.documents.random_documents) and the batch carries their segment ids and
positions, as with data.document_mask: the step keeps them apart (docs/data.md#document-masking);
bench_compare runs it against the same config without it. With --compile_only nothing is
initialised or run: the step is compiled from the abstract train state and the figures are XLA's
planned peak per device, the device's memory and whether the plan fits it (bench_context uses it to
find the longest sequence that fits without running steps that take minutes).
(figures: experiments/results/bench_train.md).
Model FLOPs per token come from kimijax.train.flops (6 N plus
causal attention, the count the ladders use; Muon's Newton-Schulz is not in MFU). For an MoE model
N is the active parameter count (active_params_M; the routed experts a token does not use are
left out), so MFU is on active FLOPs:

    python -m experiments.bench.bench_train --config=configs/bench_350m.py          # dense
    python -m experiments.bench.bench_train --config=configs/bench_350m.py:moe      # ~350M active MoE
 MFU is against
the chip's dense bf16 peak (--peak_tflops; H100/H200 SXM: 989). Attention Residuals' depth
attention (a few memory-bound [B, T, D] passes per sublayer) is not counted as model FLOPs, so its
cost shows as a longer step and a lower MFU.
"""

import json
import time

from absl import app, flags

from experiments.cli import usage_error
from kimijax.config import define_config_flag

define_config_flag('config', None, 'config file, FILE[:VARIANT[,VARIANT]].')
flags.DEFINE_integer('steps', 20, 'timed steps')
flags.DEFINE_integer('warmup', 3, 'untimed steps (the first compiles)')
flags.DEFINE_float('peak_tflops', 989.0, 'dense bf16 peak of one device, TFLOP/s')
flags.DEFINE_string('json_out', None, "also write the figures and the header's 'provenance' to this JSON file")
flags.DEFINE_string('profile_dir', None, 'write a profiler trace (perfetto JSON too) of 3 extra steps here')
flags.DEFINE_string(
  'phase1_tiles',
  '',
  "AttnRes phase-1 kernel settings for this run, 'key=int/key=int' over "
  'kernels_pallas.attnres.settings.Phase1Settings (for step-level tile sweeps; sets '
  'model.kernels.attnres_phase1)',
)
flags.DEFINE_string(
  'merge_tiles', '', 'the same for the fused phase-2 kernels (MergeNormSettings; model.kernels.attnres_merge_norm)'
)
flags.DEFINE_string(
  'kda_tiles',
  '',
  "the same for the KDA kernels (kernels_pallas.kda.settings.KdaSettings; model.kernels.kda), e.g. 'flat_branch=0'",
)
flags.DEFINE_string(
  'conv_tiles',
  '',
  'the same for the short-conv kernels (kernels_pallas.short_conv.settings.'
  "ShortConvSettings; model.kernels.short_conv), e.g. 'dz_tiles=1/dz_rows=32'",
)
flags.DEFINE_string(
  'documents',
  '',
  "'MIN,MAX': rows of packed documents of MIN to MAX tokens (uniform), their segment ids and positions "
  "in the batch (sets data.document_mask); '': one sequence per row, no segment ids",
)
flags.DEFINE_bool(
  'compile_only',
  False,
  "compile the step ahead of time from the abstract train state and run nothing: print XLA's "
  "planned peak per device (kimijax.train.memory.compiled_peak_bytes) against the device's memory "
  '(planned_peak_GiB, device_memory_GiB, fits) instead of the timings; not with --documents',
)
flags.mark_flags_as_required(['config'])
FLAGS = flags.FLAGS


def _kernel_tiles(config) -> dict:
  """--kda_tiles / --conv_tiles / --phase1_tiles / --merge_tiles as the config's model.kernels
  settings (the model passes them to the kernels; validate checks them before any compile).
  Returns the overrides, for the results."""
  tiles = {}
  for key, flag in (
    ('kda', FLAGS.kda_tiles),
    ('short_conv', FLAGS.conv_tiles),
    ('phase1', FLAGS.phase1_tiles),
    ('merge_norm', FLAGS.merge_tiles),
  ):
    if flag:
      config.model.kernels[{'phase1': 'attnres_phase1', 'merge_norm': 'attnres_merge_norm'}.get(key, key)] = flag
      tiles[key] = flag
  return tiles


def _document_lengths(text: str) -> tuple[int, int] | None:
  """--documents 'MIN,MAX' -> (MIN, MAX + 1), the range random_documents draws from; '' -> None."""
  if not text:
    return None
  try:
    low, high = (int(x) for x in text.split(','))
  except ValueError:
    raise ValueError(f"--documents={text!r}: expected 'MIN,MAX' document lengths in tokens") from None
  if not 1 <= low <= high:
    raise ValueError(f'--documents={text!r}: need 1 <= MIN <= MAX')
  return low, high + 1


def main(argv):
  del argv
  import jax
  import jax.numpy as jnp

  from experiments import runs
  from experiments.bench import timing
  from kimijax.config import config_from_flags, validate
  from kimijax.model import count_params
  from kimijax.parallel import mesh as mesh_lib
  from kimijax.train import loop as loop_lib, memory as memory_lib
  from kimijax.train.flops import active_count, model_flops_per_token
  from kimijax.train.step import build_training

  try:
    config = config_from_flags('config', validate=False)
    tiles = _kernel_tiles(config)
    documents = _document_lengths(FLAGS.documents)
    if documents:
      config.data.document_mask = True  # validation refuses an attention implementation without a mask
    config = validate(config)
  except ValueError as e:  # a bad file, variant, key or tile setting: one line naming it
    raise SystemExit(f'ConfigError: {e}') from None
  if FLAGS.compile_only and documents:
    usage_error('--compile_only takes no --documents')
  uses_tokamax = config.model.attn_impl in ('tokamax', 'gpu') or (
    config.model.mlp_kind == 'moe' and config.model.moe.impl == 'tokamax'
  )
  prov = runs.print_header(['tokamax'] if uses_tokamax else [])
  t = config.train
  mesh = mesh_lib.make_mesh(config.mesh)
  run = build_training(config, mesh)
  if FLAGS.compile_only:
    _report(_compiled_plan(config, run, mesh), prov)
    return
  start = time.perf_counter()
  state, train_step, batch_sh = jax.block_until_ready(run.init_state(config)), run.train_step, run.batch_sharding
  init_s = time.perf_counter() - start
  tokens = jax.jit(
    lambda k: jax.random.randint(k, (t.batch_size, t.seq_len + 1), 0, config.model.vocab_size),
    out_shardings=mesh_lib.replicated(mesh),
  )(jax.random.key(0))
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'mask': jnp.ones((t.batch_size, t.seq_len), jnp.float32)}
  if documents:
    from kimijax.data.documents import random_documents

    batch['segment_ids'], batch['positions'] = random_documents(t.batch_size, t.seq_len, *documents)
  batch = jax.device_put(batch, batch_sh)

  step = lambda carry: train_step(carry[0], batch)
  start = time.perf_counter()  # the first step: compilation (or a cache load) and one step
  try:
    first = loop_lib.first_step(train_step, state, batch, config, mesh)
  except memory_lib.MemoryLimitError as e:  # one line, with XLA's words (bench_context reads them)
    raise SystemExit(f'MemoryLimitError: {e}') from None
  first_step_s = time.perf_counter() - start
  step_ms, (state, metrics) = timing.loop_ms(step, first, steps=FLAGS.steps, warmup=max(FLAGS.warmup - 1, 0))
  step_s = step_ms / 1e3

  if FLAGS.profile_dir:
    with jax.profiler.trace(FLAGS.profile_dir, create_perfetto_trace=True):
      for _ in range(3):
        state, metrics = train_step(state, batch)
      jax.block_until_ready(metrics)

  n_params = count_params(state.params)
  tokens_per_step = t.batch_size * t.seq_len
  flops_per_token = model_flops_per_token(config, n_params)
  n_dev = len(jax.devices())
  tflops_per_dev = flops_per_token * tokens_per_step / step_s / n_dev / 1e12
  stats = jax.devices()[0].memory_stats() or {}
  result = {
    'device': jax.devices()[0].device_kind,
    'num_devices': n_dev,
    'params_M': n_params / 1e6,
    'active_params_M': active_count(config, n_params) / 1e6,
    'mlp_kind': config.model.mlp_kind,
    'moe_impl': config.model.moe.impl if config.model.mlp_kind == 'moe' else None,
    'mesh': ' '.join(f'{a}={n}' for a, n in mesh.shape.items()),
    'optimizer': config.optimizer.name,
    'muon_split_matrices': (config.optimizer.muon_split_matrices if config.optimizer.name != 'adamw' else None),
    'batch': t.batch_size,
    'seq_len': t.seq_len,
    'attn_impl': config.model.attn_impl,
    'remat': config.model.remat,
    'residual': config.model.residual,
    'attnres_block_size': (config.model.attnres_block_size if config.model.residual == 'attnres_block' else None),
    'residual_dtype': config.model.residual_dtype,
    'attnres_tiles': tiles,
    'documents': FLAGS.documents or None,
    'step_ms': step_s * 1e3,
    'tokens_per_sec': tokens_per_step / step_s,
    'model_tflops_per_device': tflops_per_dev,
    'mfu': tflops_per_dev / FLAGS.peak_tflops,
    'peak_memory_GiB': stats.get('peak_bytes_in_use', 0) / 2**30,
    'loss': float(metrics['loss']),
    'init_s': init_s,
    'first_step_s': first_step_s,
  }
  _report(result, prov)


def _compiled_plan(config, run, mesh) -> dict:
  """--compile_only's figures: the step compiled, not run; XLA's planned peak per device against
  what one device may use (kimijax.train.memory)."""
  import jax

  from kimijax.model import count_params
  from kimijax.train import memory as memory_lib

  start = time.perf_counter()
  planned = memory_lib.compiled_peak_bytes(run, config)
  compile_s = time.perf_counter() - start
  limit = memory_lib.device_memory(mesh.devices.flat)
  return {
    'device': jax.devices()[0].device_kind,
    'num_devices': mesh.devices.size,
    'params_M': count_params(run.abstract_state.params) / 1e6,
    'batch': config.train.batch_size,
    'seq_len': config.train.seq_len,
    'attn_impl': config.model.attn_impl,
    'remat': config.model.remat,
    'planned_peak_GiB': planned / 2**30,
    'device_memory_GiB': None if limit is None else limit[0] / 2**30,
    'fits': None if limit is None else planned <= limit[0],
    'compile_s': compile_s,
  }


def _report(result: dict, prov: dict) -> None:
  """One line per figure; with --json_out, the figures and the header's provenance as JSON too."""
  for key, value in result.items():
    print(f'{key:>24}: {value:.4g}' if isinstance(value, float) else f'{key:>24}: {value}')
  if FLAGS.json_out:
    with open(FLAGS.json_out, 'w') as f:
      json.dump({**result, 'provenance': prov}, f, indent=1)


if __name__ == '__main__':
  app.run(main)
