"""Decode speed and cache memory: hybrid KDA:MLA against all-attention, at several context lengths.

    python -m experiments.bench.bench_decode --config=configs/kimi_linear_small.py \
        --contexts=4096,32768,131072 --batch=1 [--config.model.compute_dtype=bfloat16]

For each context length L and each of the two layer patterns (--hybrid_pattern, default the
config's, and --baseline_pattern, default all attention) it builds the model from random
parameters, fills every layer's cache as if L - 1 tokens had been seen (random contents: the cost
of a decode step does not depend on them), and times jitted decode steps at position L - 1.
Prints ms per token, tokens/s (batch / step time) and the cache's bytes per sequence. The MLA
layers decode with model.mla_decode_impl (--config.model.mla_decode_impl=pallas: the split-context
kernel of kernels_pallas/mla_decode/, its settings as --config.model.kernels.mla_decode=...). The cache
is donated, so a step updates it in place as kimijax.infer.generate does. On an H200 at ~350M,
one context (both models) took about 4.5 minutes, most of it initialisation and compilation.
Results: experiments/results/bench_decode.md.
"""

import functools

from absl import app, flags

from kimijax.config import define_config_flag

define_config_flag('config', 'configs/kimi_linear_small.py', 'model config, FILE[:VARIANT[,VARIANT]].')
flags.DEFINE_list('contexts', ['4096', '32768', '131072'], 'context lengths')
flags.DEFINE_integer('batch', 1, 'sequences decoded together')
flags.DEFINE_integer('steps', 50, 'timed decode steps')
flags.DEFINE_string('hybrid_pattern', None, "layer pattern of the hybrid (default: the config's)")
flags.DEFINE_string('baseline_pattern', 'A', 'layer pattern of the baseline')
FLAGS = flags.FLAGS


def build(config, pattern: str):
  """(model, weights, model config) of `config` with layer_pattern = pattern: the params (matrices in
  the compute dtype), with the MoE biases for a model with MoE layers (kimijax.model.inference_variables)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from kimijax.config import validate
  from kimijax.model import Transformer, inference_variables

  m = config.model
  m.layer_pattern = pattern
  m.kda_impl = 'xla_recurrent'  # decoding uses kda_step whatever the impl; the scan compiles fastest for init
  validate(config)
  model = Transformer(m)
  variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  params = jax.tree.map(lambda p: p.astype(m.compute_dtype) if p.ndim > 1 else p, variables['params'])
  return model, inference_variables(params, variables.get('moe_state')), m


def bench(model, params, m, context: int, batch: int, steps: int) -> dict:
  import jax
  import jax.numpy as jnp

  from kimijax.infer.cache import cache_bytes, init_cache
  from kimijax.model import as_variables, count_params

  @jax.jit
  def random_cache(key):  # as if L - 1 tokens had been seen; no zero-filled copy first
    shapes = jax.eval_shape(lambda: init_cache(m, batch, context))
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten([jax.random.normal(k, x.shape, x.dtype) * 0.1 for k, x in zip(keys, leaves)])

  cache = random_cache(jax.random.key(1))

  @functools.partial(jax.jit, donate_argnames='cache')  # as in kimijax.infer.generate: in place
  def step(params, token, cache):
    logits, aux = model.apply(as_variables(params), token[:, None], jnp.full((batch, 1), context - 1), cache=cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), aux['cache']

  from experiments.bench import timing

  token = jnp.zeros((batch,), jnp.int32)
  # Each step rewrites position L - 1: a steady-state step at context L; the warm-up compiles.
  ms, (token, cache) = timing.loop_ms(lambda carry: step(params, *carry), (token, cache), steps=steps)
  return {
    'ms_per_token': ms,
    'tokens_per_sec': batch / ms * 1e3,
    'params_M': count_params(as_variables(params)['params']) / 1e6,
    'cache_MiB_per_seq': cache_bytes(cache) / batch / 2**20,
  }


def main(argv):
  del argv
  from experiments.cli import user_errors
  from kimijax.config import config_from_flags

  with user_errors():
    config = config_from_flags('config')
  hybrid = FLAGS.hybrid_pattern or config.model.layer_pattern
  models = {p: build(config.copy_and_resolve_references(), p) for p in (hybrid, FLAGS.baseline_pattern)}
  print(
    f'batch {FLAGS.batch}; {FLAGS.steps} timed steps; compute dtype {config.model.compute_dtype}; '
    f'MLA decode {config.model.mla_decode_impl} {config.model.kernels.mla_decode!r}'
  )
  print(f'{"context":>8} {"pattern":>8} {"params M":>9} {"ms/token":>9} {"tokens/s":>9} {"cache MiB/seq":>14}')
  for context in map(int, FLAGS.contexts):
    rows = {}
    for pattern, (model, params, m) in models.items():
      rows[pattern] = r = bench(model, params, m, context, FLAGS.batch, FLAGS.steps)
      print(
        f'{context:>8} {pattern:>8} {r["params_M"]:>9.1f} {r["ms_per_token"]:>9.3f} '
        f'{r["tokens_per_sec"]:>9.1f} {r["cache_MiB_per_seq"]:>14.2f}',
        flush=True,
      )
    speedup = rows[FLAGS.baseline_pattern]['ms_per_token'] / rows[hybrid]['ms_per_token']
    print(f'{context:>8} hybrid decode speed-up over {FLAGS.baseline_pattern!r}: {speedup:.2f}x')


if __name__ == '__main__':
  app.run(main)
