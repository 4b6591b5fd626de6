"""An estimate of a train step's memory from the config alone, checked before any step runs.

A config sized for a GPU, run on a CPU (or a batch too large for the GPU at hand), would otherwise
compile for minutes and then stop in an out-of-memory error of XLA's. `check(config, devices)`
stops first, with one line naming train.batch_size, train.seq_len and the estimate. On a GPU an
estimate over the limit is settled by XLA's plan of the compiled step (compiled_peak_bytes): XLA's
GPU compiler schedules a step to fit its memory limit, where the estimate counts every array the
backward keeps, so a plan that fits runs.

The estimate is a sum of the arrays a step keeps alive at its peak, per device:

  state        parameters (float32) and the optimizer's moments: AdamW two per parameter, Muon one
               (its AdamW side is a few vectors and the embedding, counted at one as well)
  gradients    one float32 array per parameter, plus one for the update being applied
  activations  what the backward pass keeps, per token and layer (c bytes of model.compute_dtype,
               r of model.residual_dtype, D = d_model, F = mlp_dim, H heads of Dh):
                 each sublayer's input h and its normed input          2 (r + c) D
                 SwiGLU: gate, up and their product                    3 c F
                   (MoE: the num_shared experts' as a SwiGLU,          3 c F_e s
                   plus the top_k routed rows' gate|up with             + 2 c F_e k
                   model.moe.impl='xla_blocked' or 'pallas', else       + 3 c F_e k + c k D
                   their gate, up, product and input copies; with       + c D
                   model.moe.remat only the routed experts' input)
                 attention: q, k, v and the output                     c (2 H Dh + 2 Hkv Dh)
                   with model.attn_impl='xla' also the logits and      8 H T (float32, all T keys)
                   the probabilities
                 KDA: q, k, v, the output and its gate; the float32    5 c H Dh + 4 H Dh
                   log-decay g
               With model.remat=True only each layer's input is kept, and one layer's activations
               while its backward runs.
  logits       float32 [B, T, V]; with train.loss_chunk > 0 (kimijax/train/loss.py) one chunk's
               float32 [chunk, V]

XLA reuses buffers and fuses; the estimate is meant to be of the right size, not exact, and to
err low (tests/train/test_memory.py compares it with XLA's own memory analysis of compiled steps on
the CPU); where it is over a GPU's limit, XLA's plan decides (above). The device's memory: a GPU's
allocator limit (`memory_stats()['bytes_limit']`); on a CPU, the host's available memory (/proc/meminfo
MemAvailable), shared by all its devices. Where a GPU's limit is JAX's default share of it (0.75,
XLA_PYTHON_CLIENT_MEM_FRACTION unset), a step that fits 0.95 of it is told to set the variable; an
MoE model is told model.moe.remat before model.remat. train.check_memory=False skips the check.

--mode=eval's step is checked the same way (check_eval, eval_estimate): a forward pass, whose
parameters, residual stream and largest sublayer (or logits) are counted low, before the
checkpoint is read or the step compiled; on a GPU XLA's plan of the eval step settles an estimate
over the limit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib
from kimijax.schema import ConfigError

GiB = 2**30


class MemoryLimitError(ConfigError):
  """The train step needs more memory than the device has; the message names the batch, the
  sequence length and the estimate."""


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes of one train step, in all (over all devices), by part."""

  state: int
  gradients: int
  activations: int
  logits: int

  @property
  def total(self) -> int:
    return self.state + self.gradients + self.activations + self.logits

  def per_device(self, mesh_sizes: dict[str, int]) -> int:
    """Bytes per device on a mesh of {'data', 'fsdp', 'tensor'[, 'expert']} sizes: parameters and
    optimizer state split over fsdp x tensor (replicated across data), activations over every axis."""
    model_ways = mesh_sizes.get('fsdp', 1) * mesh_sizes.get('tensor', 1)
    all_ways = model_ways * mesh_sizes.get('data', 1) * mesh_sizes.get('expert', 1)
    return (self.state + self.gradients) // model_ways + (self.activations + self.logits) // all_ways


def _bytes(dtype: str) -> int:
  return 2 if dtype == 'bfloat16' else 4


def _mlp_bytes(model: ml_collections.ConfigDict, c: int) -> int:
  """Bytes per token the backward keeps of the MLP: SwiGLU's gate, up and product; in an MoE
  model (counted for every layer) those of the top_k + num_shared experts and the routed inputs."""
  if model.mlp_kind != 'moe':
    return 3 * c * model.mlp_dim
  hidden = config_lib.moe_hidden(model)[0]
  shared = 3 * hidden * model.moe.num_shared  # the shared experts as a SwiGLU
  if model.moe.remat:  # the routed experts keep only their input
    return c * (shared + model.d_model)
  if model.moe.impl in ('xla_blocked', 'pallas'):  # gate|up of the top_k rows in the padded slots (kimijax/ops/moe.py)
    return c * (shared + 2 * hidden * model.moe.top_k)
  return c * (shared + 3 * hidden * model.moe.top_k + model.moe.top_k * model.d_model)


def _mixer_bytes(model: ml_collections.ConfigDict, kind: str, seq_len: int) -> int:
  """Bytes per token of one mixer's arrays ('A' or 'K'): KDA's q, k, v, output, gate and log-decay;
  attention's q, k, v and output, with model.attn_impl='xla' also its float32 logits and probabilities."""
  c = _bytes(model.compute_dtype)
  if kind == 'K':
    heads, head_dim = config_lib.kda_dims(model)
    return 5 * c * heads * head_dim + 4 * heads * head_dim
  heads = model.num_heads
  if model.attention_kind == 'mla':
    nope, rope, v = config_lib.mla_dims(model)
    total = c * (heads * (2 * (nope + rope) + 2 * v) + model.mla_kv_lora_rank)
  else:
    head_dim = model.d_model // heads
    total = c * (2 * heads * head_dim + 2 * config_lib.num_kv_heads(model) * head_dim)
  if model.attn_impl == 'xla':  # the [B, H, T, T] logits and probabilities, float32
    total += 8 * heads * seq_len
  return total


def layer_activation_bytes(model: ml_collections.ConfigDict, kind: str, seq_len: int) -> int:
  """Bytes per token that the backward keeps of one layer ('A' or 'K' mixer and its MLP)."""
  c, r, d = _bytes(model.compute_dtype), _bytes(model.residual_dtype), model.d_model
  # two sublayers' inputs and normed inputs; the MLP; the mixer
  return 2 * (r + c) * d + _mlp_bytes(model, c) + _mixer_bytes(model, kind, seq_len)


def estimate(config: ml_collections.ConfigDict, n_params: int) -> Estimate:
  """The step's memory (see the module docstring) for a model of n_params parameters."""
  m, t = config.model, config.train
  tokens = t.batch_size * t.seq_len
  logits = 4 * (min(t.loss_chunk, tokens) if t.loss_chunk else tokens) * m.vocab_size
  moments = 2 if config.optimizer.name == 'adamw' else 1
  per_layer = [layer_activation_bytes(m, kind, t.seq_len) for kind in config_lib.layer_kinds(m)]
  if m.remat:  # each layer's input kept; one layer's activations live during its backward
    kept = len(per_layer) * _bytes(m.residual_dtype) * m.d_model + max(per_layer)
  else:
    kept = sum(per_layer)
  return Estimate(
    state=4 * n_params * (1 + moments),
    gradients=2 * 4 * n_params,
    activations=tokens * kept,
    logits=logits,
  )


def _forward_sublayer_bytes(model: ml_collections.ConfigDict, kind: str, seq_len: int) -> int:
  """Bytes per token that a forward pass must hold at once inside one sublayer, counted low: an
  MLP's gate and up ([T, F] of the hidden units a token uses: an MoE layer's top_k routed and
  num_shared experts'); attention's float32 logits and probabilities with model.attn_impl='xla',
  else its q, k, v and output; KDA's arrays (_mixer_bytes)."""
  c = _bytes(model.compute_dtype)
  if kind == 'MLP':
    if model.mlp_kind != 'moe':
      return 2 * c * model.mlp_dim
    return 2 * c * config_lib.moe_hidden(model)[0] * (model.moe.top_k + model.moe.num_shared)
  if kind == 'A' and model.attn_impl == 'xla':
    return 8 * model.num_heads * seq_len
  return _mixer_bytes(model, kind, seq_len)


def eval_estimate(config: ml_collections.ConfigDict, param_bytes: int) -> Estimate:
  """The eval step's memory in all: a forward pass at config.train's batch x seq_len, nothing kept
  for a backward and no optimizer state. What it must hold at once, counted low (it is checked
  against XLA's memory analysis of the compiled eval step in tests/train/test_memory.py): the
  parameters as held (`param_bytes`, all of them), the residual stream, and at the peak either the
  largest sublayer's arrays (_forward_sublayer_bytes) or the float32 logits (one chunk's with
  train.loss_chunk)."""
  m, t = config.model, config.train
  tokens = t.batch_size * t.seq_len
  logits = 4 * (min(t.loss_chunk, tokens) if t.loss_chunk else tokens) * m.vocab_size
  kinds = {'MLP', *config_lib.layer_kinds(m)}
  sublayer = tokens * max(_forward_sublayer_bytes(m, kind, t.seq_len) for kind in kinds)
  residual = tokens * _bytes(m.residual_dtype) * m.d_model
  return Estimate(
    state=param_bytes,
    gradients=0,
    activations=residual + (sublayer if sublayer >= logits else 0),
    logits=logits if logits > sublayer else 0,
  )


def _host_available_bytes() -> int | None:
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def device_memory(devices) -> tuple[int, str] | None:
  """(bytes one device may use, what that is) for `devices`; None where it cannot be told. On a
  CPU every device shares the host's memory, so the bytes are the host's available memory
  divided by the number of devices."""
  devices = list(devices)
  if devices[0].platform == 'cpu':
    available = _host_available_bytes()
    if available is None:
      return None
    return available // len(devices), f"this host's {available / GiB:.1f} GiB of available memory"
  limits = []
  for device in devices:
    if device.process_index != jax.process_index():
      continue
    try:
      stats = device.memory_stats() or {}
    except Exception:  # a backend without memory statistics
      return None
    if 'bytes_limit' in stats:
      limits.append(int(stats['bytes_limit']))
  if not limits:
    return None
  return min(limits), f'the {min(limits) / GiB:.1f} GiB of memory XLA may use on each {devices[0].device_kind}'


def compiled_peak_bytes(run, config: ml_collections.ConfigDict) -> int:
  """XLA's plan for one device of the train step of `run` (kimijax.train.step.build_training) at
  config.train's batch and sequence length, compiled ahead of time from the abstract state, so
  nothing is initialised or run: the arguments, outputs and temporaries of its buffer assignment,
  less the outputs that reuse the donated state's buffers. The batch carries no document segments."""
  shape = (config.train.batch_size, config.train.seq_len)
  spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=run.batch_sharding)
  batch = {'inputs': spec(jnp.int32), 'targets': spec(jnp.int32), 'mask': spec(jnp.float32)}
  stats = run.train_step.lower(run.abstract_state, batch).compile().memory_analysis()
  return (
    stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
  )


def compiled_eval_peak_bytes(eval_step, weights, config: ml_collections.ConfigDict, batch_sharding) -> int:
  """XLA's plan for one device of `eval_step` (kimijax.train.step.make_eval_step, jitted in its mesh)
  on `weights` (ShapeDtypeStructs with their shardings) at config.train's batch and sequence
  length, compiled ahead of time, nothing allocated: its arguments, outputs and temporaries."""
  shape = (config.train.batch_size, config.train.seq_len)
  spec = lambda dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
  batch = {'inputs': spec(jnp.int32), 'targets': spec(jnp.int32), 'mask': spec(jnp.float32)}
  stats = eval_step.lower(weights, batch).compile().memory_analysis()
  return stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes


def describe(config: ml_collections.ConfigDict, est: Estimate, mesh_sizes: dict[str, int], step: str = 'train') -> str:
  """The estimate of the `step` ('train' or 'eval', which holds no optimizer state or gradients) at
  config.train's batch and length, per device and by part."""
  t = config.train
  ways = math.prod(mesh_sizes.values())
  where = f' per device of {ways}' if ways > 1 else ''
  if step == 'train':
    parts = {'parameters and optimizer state': est.state, 'gradients': est.gradients}
  else:
    parts = {'parameters': est.state}
  parts.update(activations=est.activations, logits=est.logits)
  listed = ', '.join(f'{name} {size / GiB:.1f} GiB' for name, size in parts.items())
  return (
    f'the {step} step at train.batch_size={t.batch_size} x train.seq_len={t.seq_len} needs about '
    f'{est.per_device(mesh_sizes) / GiB:.1f} GiB{where} (estimated: {listed} in all)'
  )


# The train.loss_chunk the memory check suggests: a chunk's float32 logits are 512 MiB at a vocabulary of 32768.
SUGGESTED_LOSS_CHUNK = 4096
# JAX's allocator gives XLA this share of each GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION
# sets it; the check suggests the larger share where the step would fit in it.
JAX_DEFAULT_GPU_FRACTION = 0.75
SUGGESTED_GPU_FRACTION = 0.95


def _remedies(config: ml_collections.ConfigDict) -> list[dict]:
  """The changes that lower the step's memory without changing its maths, those not yet made, in the
  order the check suggests them: model.moe.remat (MoE models: one more expert forward),
  model.remat, train.loss_chunk, the last two together."""
  m = config.model
  moe_remat = {'model.moe.remat': True} if m.mlp_kind == 'moe' and not (m.moe.remat or m.remat) else {}
  remat = {} if m.remat else {'model.remat': True}
  chunk = {} if config.train.loss_chunk else {'train.loss_chunk': SUGGESTED_LOSS_CHUNK}
  return [c for c in (moe_remat, remat, chunk, {**remat, **chunk} if remat and chunk else {}) if c]


def _setting(changes: dict) -> str:
  """A remedy of _remedies as advice: 'set KEY=VALUE and ...'."""
  return f'set {" and ".join(f"{k}={v}" for k, v in changes.items())}'


def raised_gpu_limit(devices, limit: int) -> int | None:
  """The bytes each GPU would give XLA with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95, where `limit`
  (device_memory) is JAX's default share (the variable unset, an allocator that applies it);
  None elsewhere."""
  if devices[0].platform != 'gpu' or os.environ.get('XLA_PYTHON_CLIENT_MEM_FRACTION'):
    return None
  if os.environ.get('XLA_PYTHON_CLIENT_ALLOCATOR', 'default') == 'platform':
    return None
  return int(limit / JAX_DEFAULT_GPU_FRACTION * SUGGESTED_GPU_FRACTION)


def gpu_fraction_advice(raised: int) -> str:
  """The advice to start with the larger allocator share, `raised` bytes per GPU (raised_gpu_limit)."""
  return (
    f'start with XLA_PYTHON_CLIENT_MEM_FRACTION={SUGGESTED_GPU_FRACTION} (JAX gives XLA '
    f'{JAX_DEFAULT_GPU_FRACTION} of each GPU by default; about {raised / GiB:.1f} GiB then)'
  )


def untried_remedies(config: ml_collections.ConfigDict, devices) -> list[str]:
  """What an out-of-memory step could try, most of it untried in `config`: the larger GPU
  allocator share where JAX's default applies, the remedies of _remedies, a smaller batch."""
  advice = []
  memory = device_memory(devices)
  raised = memory and raised_gpu_limit(list(devices), memory[0])
  if raised:
    advice.append(gpu_fraction_advice(raised))
  advice += [_setting(changes) for changes in _remedies(config)]
  return advice + ['lower train.batch_size or train.seq_len']


def _changed(config: ml_collections.ConfigDict, changes: dict) -> ml_collections.ConfigDict:
  config = config.copy_and_resolve_references()
  for path, value in changes.items():
    config_lib.override(config, path, value)
  return config


class _OverLimit(NamedTuple):
  limit: int
  what: str  # the limit in words
  planned: int | None  # XLA's planned peak per device, where it was asked for
  advice: list[str]  # the larger GPU allocator share, where it would fit


def _over_limit(config: ml_collections.ConfigDict, devices, need: float, plan, label: str):
  """The shared start of check and check_eval for a step estimated at `need` bytes per device:
  None where it fits, or that cannot be told, or with train.check_memory=False; a line for the
  start-up report ('memory: {label} ...') where the estimate is over the limit but XLA's plan
  (on a GPU, `plan()`) fits; otherwise an _OverLimit to name in the error."""
  if not config.train.check_memory:
    return None
  memory = device_memory(devices)
  if memory is None:
    return None
  limit, what = memory
  if need <= limit:
    return None
  planned = plan() if plan is not None and devices[0].platform == 'gpu' else None
  if planned is not None and planned <= limit:
    return (
      f'memory: {label} {need / GiB:.1f} GiB per device, over {what}; '
      f"XLA's plan of the step, {planned / GiB:.1f} GiB, fits"
    )
  advice = []
  raised = raised_gpu_limit(devices, limit)
  if raised is not None and (planned if planned is not None else need) <= raised:
    advice.append(gpu_fraction_advice(raised))
  return _OverLimit(limit, what, planned, advice)


def _limit_error(description: str, over: _OverLimit) -> MemoryLimitError:
  """The one-line error of check and check_eval: the step's estimate (describe), XLA's plan where
  there is one, the limit and the advice."""
  planned = f" (XLA's plan of the step: {over.planned / GiB:.1f} GiB)" if over.planned is not None else ''
  return MemoryLimitError(
    f'{description}{planned}, more than {over.what}: {", or ".join(over.advice)} '
    '(train.check_memory=False skips this check)'
  )


def check(
  config: ml_collections.ConfigDict, devices, n_params: int, mesh_sizes: dict[str, int], plan=None
) -> str | None:
  """MemoryLimitError when the step exceeds what each device may use (nothing when that cannot be
  told, or with train.check_memory=False). The estimate decides, except on a GPU given `plan`, a
  callable that returns XLA's planned peak per device (compiled_peak_bytes): there an estimate
  over the limit is checked against the plan, since XLA's GPU compiler schedules a step to fit
  its memory limit and the estimate can then err high; a plan that fits lets the step run and
  is returned as a line for the start-up report."""
  est = estimate(config, n_params)
  over = _over_limit(config, devices, est.per_device(mesh_sizes), plan, 'estimated')
  if not isinstance(over, _OverLimit):
    return over
  limit, advice = over.limit, over.advice  # the advice grows in place
  for changes in _remedies(config):
    need = estimate(_changed(config, changes), n_params).per_device(mesh_sizes)
    if need <= limit:
      advice.append(f'{_setting(changes)} (about {need / GiB:.1f} GiB)')
      break
  advice.append('lower train.batch_size or train.seq_len')
  if devices[0].platform == 'cpu':
    advice.append('use a config sized for a CPU, such as configs/default.py')
  raise _limit_error(describe(config, est, mesh_sizes), over)


def check_eval(
  config: ml_collections.ConfigDict, devices, param_bytes: int, mesh_sizes: dict[str, int], plan=None
) -> str | None:
  """MemoryLimitError, naming train.batch_size and train.seq_len (the eval batch) and the estimate,
  when the eval step (eval_estimate, for parameters of param_bytes as held) exceeds what each
  device may use; as `check` does for the train step, before anything is restored or compiled:
  nothing when that cannot be told or with train.check_memory=False, and on a GPU given `plan`
  (XLA's planned peak per device, compiled_eval_peak_bytes) the plan decides an estimate over the
  limit, a plan that fits being returned as a line to print."""
  est = eval_estimate(config, param_bytes)
  over = _over_limit(config, devices, est.per_device(mesh_sizes), plan, 'eval step estimated at')
  if not isinstance(over, _OverLimit):
    return over
  limit, advice = over.limit, over.advice  # the advice grows in place
  if not config.train.loss_chunk:
    chunked = eval_estimate(_changed(config, {'train.loss_chunk': SUGGESTED_LOSS_CHUNK}), param_bytes)
    if chunked.per_device(mesh_sizes) <= limit:
      advice.append(
        f'set train.loss_chunk={SUGGESTED_LOSS_CHUNK} (about {chunked.per_device(mesh_sizes) / GiB:.1f} GiB)'
      )
  advice.append('lower train.seq_len or train.batch_size')
  raise _limit_error(describe(config, est, mesh_sizes, 'eval'), over)
