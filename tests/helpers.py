"""Set-ups several test files share: a tiny model with random parameters, and a few real train
steps on a mesh. The float64 oracles the tests compare against are in tests/oracles.py."""

import contextlib
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

from kimijax import config as config_lib
from kimijax.model import Transformer
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.step import build_training

# ----------------------------------------------------------------------------- child processes


def cpu_subprocess_env(**extra: str) -> dict:
  """This process's environment for a child process on one CPU device: JAX_PLATFORMS=cpu and
  XLA_FLAGS without conftest's 8 fake devices (its other flags kept), then `extra`."""
  flags = [
    f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform_device_count')
  ]
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  if flags:
    env['XLA_FLAGS'] = ' '.join(flags)
  env['JAX_PLATFORMS'] = 'cpu'
  env.update(extra)
  return env


# ----------------------------------------------------------------------------- a tiny model


B, T = 2, 9


def tiny_model_config(**overrides):
  """A validated tiny float32 model config: V=37, D=32, 2 layers, 4 heads of 8, GQA 2 kv heads."""
  c = config_lib.base_config()
  c.model.update(
    dict(
      vocab_size=37,
      d_model=32,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      attention_kind='gqa',
      mlp_dim=48,
      compute_dtype='float32',
    )
  )
  c.model.update(overrides)
  return config_lib.validate(c).model


def init_params(cfg, seed=0):
  """Plain (unboxed) params with O(1)-scale random values, so attention is far from uniform.

  Only the structure comes from the model (via eval_shape); every value is drawn here.
  """
  tokens = jnp.zeros((1, T), jnp.int32)
  params = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(seed), tokens)['params'])
  leaves, treedef = jax.tree.flatten_with_path(params)
  rng = np.random.default_rng(seed + 100)
  new = []
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    if 'scale' in name:  # norm gains around 1
      x = 1.0 + 0.3 * rng.standard_normal(leaf.shape)
    elif 'embed' in name:
      x = rng.standard_normal(leaf.shape)
    else:  # matrices: fan-in of the first axis
      fan_in = leaf.shape[0] * (leaf.shape[1] if name.endswith("['out']") else 1)
      gain = 2.0 if ("['query']" in name or "['key']" in name) else 1.0
      x = gain * rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
    new.append(jnp.asarray(x, leaf.dtype))
  return jax.tree.unflatten(treedef, new)


def random_tokens(cfg, seed=1, b=B, t=T):
  return jnp.asarray(np.random.default_rng(seed).integers(0, cfg.vocab_size, (b, t)), jnp.int32)


_FORWARDS = {}


def forward(cfg, params, tokens, positions=None):
  """Jitted Transformer.apply, one compiled function per config (cheaper than eager on CPU)."""
  key = cfg.to_json()
  if key not in _FORWARDS:
    _FORWARDS[key] = jax.jit(Transformer(cfg).apply)
  return _FORWARDS[key]({'params': params}, tokens, positions)


def impl_params(impls):
  """pytest params over an op's IMPLS (the tokamax test_base pattern: one suite, every entry), an
  entry whose capability gpu_only is set marked gpu (skipped off the GPU)."""
  import pytest

  return [
    pytest.param(name, id=name, marks=[pytest.mark.gpu] if getattr(impl, 'gpu_only', False) else [])
    for name, impl in impls.items()
  ]


def rel_err(a, ref):
  return float(np.max(np.abs(np.asarray(a, np.float64) - ref)) / np.max(np.abs(ref)))


def rel_rmse(a, ref):
  """Relative RMSE over a whole tensor (float64), as fla's tests measure kernel errors."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.sqrt(np.mean((a - ref) ** 2) / np.mean(ref**2)))


def cross_entropy(logits_btv, tokens_bt):
  """Next-token loss: logits at t predict token t + 1."""
  logp = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens_bt[:, 1:, None], axis=-1))


# ----------------------------------------------------------------------------- short conv inputs


def short_conv_inputs(seed, b, t, h, dk, dtype=jnp.float32):
  """x [B, T, H, K] ~ N(0, 1) in dtype, taps w [4, H, K] ~ U(-0.5, 0.5) float32, a cotangent dy."""
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (b, t, h, dk), jnp.float32).astype(dtype)
  w = jax.random.uniform(kw, (4, h, dk), jnp.float32, -0.5, 0.5)
  dy = jax.random.normal(kd, (b, t, h, dk), jnp.float32)
  return x, w, dy


def short_conv_grads(impl, activation, x, w, dy, settings=None):
  """The gradients in x and w of sum(short_conv(x, w) * dy) under impl (and its kernels' settings)."""
  from kimijax.ops.short_conv import short_conv

  loss = lambda x, w: jnp.sum(short_conv(x, w, activation, impl=impl, settings=settings)[0].astype(jnp.float32) * dy)
  return jax.jit(jax.grad(loss, (0, 1)))(x, w)


# ----------------------------------------------------------------------------- AttnRes inputs


def random_block(n, s, b=B, t=T, d=16, seed=0):
  """n sources of very different scales, a partial sum and S queries, float32 NumPy."""
  rng = np.random.default_rng(seed)
  scales = np.geomspace(1e-2, 30.0, n + 1)
  arrays = [(rng.standard_normal((b, t, d)) * c).astype(np.float32) for c in scales]
  return arrays[:n], arrays[n], (0.5 * rng.standard_normal((s, d))).astype(np.float32)


def random_merge(shape, seed=5, dtype=jnp.float32):
  """Phase-2 inputs (o, lse, partial, query, scale) with gates spread over (0, 1)."""
  rng = np.random.default_rng(seed)
  o = rng.standard_normal(shape) * 2
  partial = rng.standard_normal(shape) * 0.3
  lse = rng.standard_normal(shape[:-1]) * 2
  q, scale = 0.5 * rng.standard_normal(shape[-1:]), 1 + 0.3 * rng.standard_normal(shape[-1:])
  return (
    jnp.asarray(o, dtype),
    jnp.asarray(lse, jnp.float32),
    jnp.asarray(partial, dtype),
    jnp.asarray(q, jnp.float32),
    jnp.asarray(scale, jnp.float32),
  )


# ----------------------------------------------------------------------------- train steps on a mesh


STEPS = 3
BATCH, SEQ = 8, 16
RTOL = 1e-5

VARIANTS = {
  # vocab 256 divides every tensor size used here (the 'vocab' axis is tensor-sharded).
  'mha': dict(d_model=32, num_heads=4, num_kv_heads=0, attention_kind='mha'),
  'gqa': dict(d_model=64, num_heads=8, num_kv_heads=4, attention_kind='gqa'),
}


def sharding_config(variant: str, shape=(1, 1, 1)):
  """A validated float32 config of VARIANTS[variant] for STEPS steps on a (data, fsdp, tensor) mesh."""
  c = config_lib.base_config()
  c.model.update(VARIANTS[variant])
  c.model.compute_dtype = 'float32'
  c.model.vocab_size = 256
  c.model.num_layers = 2
  c.model.mlp_dim = 64
  c.train.batch_size, c.train.seq_len, c.train.steps = BATCH, SEQ, STEPS
  # A constant, large learning rate so that every step moves the parameters noticeably.
  c.optimizer.schedule, c.optimizer.warmup_steps, c.optimizer.learning_rate = 'constant', 0, 1e-2
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
  return config_lib.validate(c)


def make_batches(seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, 256, size=(BATCH, SEQ + 1), dtype=np.int32)
    mask = (rng.random((BATCH, SEQ)) > 0.1).astype(np.float32)
    out.append({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:], 'mask': mask})
  return out


BATCHES = make_batches()


def train_steps(config, devices):
  """(per-step metrics as numpy, final state, mesh) of STEPS real train steps on `devices`."""
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  run = build_training(config, mesh)
  state, train_step, batch_sh = run.init_state(config), run.train_step, run.batch_sharding
  history = []
  for batch in BATCHES:
    gbatch = {k: jax.make_array_from_process_local_data(batch_sh, v) for k, v in batch.items()}
    state, metrics = train_step(state, gbatch)
    history.append({k: np.asarray(metrics[k]) for k in ('loss', 'grad_norm', 'finite')})
  return history, state, mesh, gbatch


# ----------------------------------------------------------------------------- tiny run.py trainings


# configs/default.py shrunk to a few seconds a step on one CPU device, for run.py in subprocesses
# (tests/train/test_multiprocess.py, tests/experiments/test_launch_local.py). A constant lr from
# step 1, so that the schedule does not depend on train.steps (a resumed run follows the same
# curve) and every step moves the parameters (the default warmup starts at lr 0).
TINY_RUN = {
  'model.d_model': 64,
  'model.num_layers': 2,
  'model.mlp_dim': 128,
  'train.seq_len': 64,
  'train.batch_size': 4,
  'train.log_every': 1,
  'train.eval_batches': 2,
  'train.plot': False,
  'optimizer.schedule': 'constant',
  'optimizer.warmup_steps': 0,
}


def tiny_run_overrides(every: int) -> dict:
  """TINY_RUN with an eval and a checkpoint every `every` steps (and at the last)."""
  return dict(TINY_RUN, **{'train.eval_every': every, 'train.checkpoint_every': every})


def run_py_args(workdir, overrides: dict, steps: int) -> list[str]:
  """run.py's arguments for configs/default.py with `overrides` for `steps` steps."""
  return ['--config=configs/default.py', f'--workdir={workdir}'] + [
    f'--config.{k}={v}' for k, v in dict(overrides, **{'train.steps': steps}).items()
  ]


def train_losses(workdir) -> dict:
  """{step: train loss} of a run's metrics.jsonl."""
  from kimijax.train.metrics import read_metrics

  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}


def eval_losses(workdir) -> dict:
  """{step: eval loss} of a run's metrics.jsonl."""
  from kimijax.train.metrics import read_metrics

  return {r['step']: r['eval_loss'] for r in read_metrics(workdir) if 'eval_loss' in r}


# jax.config options of a persistent XLA compilation cache that stores every executable: tests whose
# train() calls jit the same programs afresh load them instead of compiling again on 2 CPU cores
# (cached executables are the same programs, bit for bit). As environment variables: name.upper().
CACHE_OPTIONS = {
  'jax_compilation_cache_dir': None,
  'jax_persistent_cache_min_compile_time_secs': 0.0,
  'jax_persistent_cache_min_entry_size_bytes': 0,
}


@contextlib.contextmanager
def persistent_compile_cache(directory):
  """CACHE_OPTIONS with the cache in `directory` while the block runs; the previous options after."""
  options = {**CACHE_OPTIONS, 'jax_compilation_cache_dir': str(directory)}
  saved = {name: getattr(jax.config, name) for name in options}
  for name, value in options.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield str(directory)
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    compilation_cache.reset_cache()
