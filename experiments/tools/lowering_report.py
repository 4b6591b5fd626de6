"""How long a config's training gradient takes to trace and lower for an H200, and how big the
lowered module is, on any machine (no GPU needed).

    python -m experiments.tools.lowering_report --config=configs/bench_350m.py:hybrid [--seq_len=256]

This is the host-side part of a GPU compile: JAX traces the model and lowers every Pallas kernel
to Triton IR before XLA sees the module, and XLA then parses and compiles a module of the size
printed here. The loss's gradient is lowered for CUDA through jax.export (an abstract H200, as
experiments/tools/triton_report.py does), at the config's model and batch 2 x --seq_len (the
lowering does not depend on the batch's size); attention runs the XLA form, since cuDNN's and
tokamax's lowering needs a GPU. Prints the seconds, the module's characters and how often each
Pallas kernel's name occurs in it: a kernel that every layer calls with the same shapes should
be lowered once (kernels_pallas/__init__.py), not once per layer. Measured:
experiments/results/bench_kda.md.
"""

import collections
import re
import time

import jax
import jax.numpy as jnp
from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module
  next to others that define flags of the same names)."""
  from kimijax.config import define_config_flag

  define_config_flag('config', None, 'config file, FILE[:VARIANT[,VARIANT]].')
  flags.DEFINE_integer('seq_len', 256, 'tokens per sequence of the lowered batch (2 sequences)')
  flags.DEFINE_integer('top', 12, 'kernel names to list')


# Pallas kernel names (pallas_call(name=...)) as they occur in the serialized Triton IR.
_KERNEL_NAME = re.compile(r'\\00((?:kda|short_conv|attnres|max_logits)_[a-z0-9_]+)\\00')


def lower_gradient(model_cfg, seq_len: int) -> tuple[float, str]:
  """(seconds, module text) of the next-token loss's gradient of Transformer(model_cfg)."""
  from experiments.tools.triton_report import lower_for_h200
  from kernels_pallas import common
  from kimijax.model import Transformer

  model = Transformer(model_cfg)
  tokens = jax.ShapeDtypeStruct((2, seq_len), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((2, seq_len), jnp.int32)))

  def loss(params, tokens):
    logits, _ = model.apply(params, tokens)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1))

  interpreted = common.kernels_interpreted
  common.kernels_interpreted = lambda: False  # lower the kernels as on the GPU, through Triton
  try:
    start = time.perf_counter()
    module = lower_for_h200(jax.grad(loss), params, tokens)
    return time.perf_counter() - start, module
  finally:
    common.kernels_interpreted = interpreted


def kernel_counts(module: str) -> collections.Counter:
  """{Pallas kernel name: occurrences in the module}."""
  return collections.Counter(m.group(1) for m in _KERNEL_NAME.finditer(module))


def main(argv):
  del argv
  from experiments.cli import user_errors
  from kimijax.config import config_from_flags

  with user_errors():
    cfg = config_from_flags('config').model
  cfg.attn_impl = 'xla'
  seconds, module = lower_gradient(cfg, FLAGS.seq_len)
  counts = kernel_counts(module)
  print(
    f'{jax.__version__=}; layers {cfg.num_layers} ({cfg.layer_pattern or "all attention"}); '
    f'lowered in {seconds:.1f} s; module {len(module) / 1e6:.2f} M characters; '
    f'{sum(counts.values())} Pallas kernel names, {len(counts)} distinct'
  )
  for name, n in counts.most_common(FLAGS.top):
    print(f'  {name}: {n}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
