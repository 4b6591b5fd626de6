"""Decode speed against the memory roofline, and cache memory: hybrid KDA:MLA against all-attention,
at several context lengths.

    python -m experiments.bench.bench_decode --config=configs/kimi_linear_small.py \
        --contexts=4096,32768,131072 --batch=1 [--config.model.compute_dtype=bfloat16]
    python -m experiments.bench.bench_decode --config=configs/default.py --config.model.layer_pattern=KA \
        --contexts=32 --steps=4 --copy_gib=0.01                                            # CPU smoke

For each context length L and each of the two layer patterns (--hybrid_pattern, default the
config's, and --baseline_pattern, default all attention) it builds the model from random
parameters, fills every layer's cache as if L - 1 tokens had been seen (random contents: the cost
of a decode step does not depend on them), and times
- 'step': --steps jitted decode steps at position L - 1 (the argmax of the logits), each given the
  cache the one before returned (donated, so a step updates it in place);
- 'loop': kimijax.infer.generate.decode, the generation loop on the device that `generate` and
  `run.py --mode=generate` run, greedy, over the same cache: N = --steps decode steps at positions
  L - N - 1 to L - 2 in one call (its prompt L - N - 1 tokens long), per token. Step and loop agree
  when the loop adds nothing to the steps it runs.

The memory roofline of one step is the bytes it must read over the copy bandwidth measured in the
same run (a jitted, donated x + 1 over a --copy_gib GiB float32 buffer: read + write bytes over its
time). The bytes: every parameter in its dtype (an untied input embedding only the batch's rows; a
tied one is read whole as the head; an MoE layer's every expert, an upper bound at small batches),
each attention layer's cache over the L positions, each KDA layer's state and conv states read and
written. 'step / roofline' is how far a step is from reading its bytes once at copy speed,
'loop / roofline' the same for a token of the loop (what generation runs: a step with little
device time is bound by the host's dispatch of its jitted call, which the loop does not pay); the
hybrid's row gives its speed-up over the baseline and the ratio of their bytes (the bound the
layer pattern sets). The MLA layers decode with model.mla_decode_impl
(--config.model.mla_decode_impl=pallas: the split-context kernel of kernels_pallas/mla_decode/, its
settings as --config.model.kernels.mla_decode=...), the KDA layers with kda_decode under
model.kda_impl (--config.model.kda_impl=pallas: one kernel per layer, kernels_pallas/kda/decode.py,
or with --config.model.kernels.kda=fused_decode=0 XLA's convolutions and gates before the step
kernel; configs/kimi_linear_small.py's own 'xla' decodes with XLA's form). --kda_tiles times the
hybrid under several KDA kernel settings in one run, the same parameters and cache
(--kda_tiles=,fused_decode=0: the decode kernel against its composed form). --profile_dir traces a few more
steps of each model for experiments/tools/profile_summary.

Prints the benchmarks' header line (experiments/runs.py print_header), then Markdown: the settings
and the copy bandwidth, then one table row per context and model, the baseline's first, each printed
as soon as it is measured. At ~350M most of a run is compilation (minutes per context on an H100 or
H200), not the timed steps: --baseline_pattern='' leaves the baseline out (an A/B of --kda_tiles
needs none), and with JAX_COMPILATION_CACHE_DIR set a second run of the same shapes reuses it. Results:
experiments/results/bench_decode.md.
"""

import functools

from absl import app, flags

from experiments.cli import usage_error

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  from kimijax.config import define_config_flag

  define_config_flag('config', 'configs/kimi_linear_small.py', 'model config, FILE[:VARIANT[,VARIANT]].')
  flags.DEFINE_list('contexts', ['4096', '32768', '131072'], 'context lengths (each at least --steps + 2)')
  flags.DEFINE_integer('batch', 1, 'sequences decoded together')
  flags.DEFINE_integer('steps', 50, 'timed decode steps, one by one, and the decode steps of one loop call')
  flags.DEFINE_string('hybrid_pattern', None, "layer pattern of the hybrid (default: the config's)")
  flags.DEFINE_string('baseline_pattern', 'A', "layer pattern of the baseline ('': none, the hybrid alone)")
  flags.DEFINE_float('copy_gib', 2.0, 'GiB of the buffer whose copy measures the memory bandwidth')
  flags.DEFINE_list(
    'kda_tiles',
    [''],
    "the hybrid once per entry, its KDA kernels' settings model.kernels.kda = ENTRY ('key=int/key=int'; '' "
    "the config's own), the same parameters: e.g. ',fused_decode=0' times the decode kernel's A/B in one run",
  )
  flags.DEFINE_string(
    'profile_dir',
    None,
    'also trace PROFILE_STEPS more decode steps of each pattern at each context into '
    'DIR/hybrid_CONTEXT and DIR/baseline_CONTEXT (perfetto JSON too; experiments/tools/profile_summary reads one)',
  )


LOOP_CALLS = 3  # timed loop calls (after one that compiles)
PROFILE_STEPS = 3  # profile_summary's default --steps
HEADER = (
  '| context | pattern | params M | step ms | tokens/s | loop ms/token | cache MiB/seq | read MiB | roofline ms '
  '| step / roofline | loop / roofline | hybrid speed-up (bytes ratio) |'
)


def random_like(shapes, key, std: float):
  """Arrays of the shapes and dtypes of the pytree `shapes` (jax.ShapeDtypeStruct leaves), N(0,
  std): a benchmark's stand-in for values its timing does not depend on. Drawn leaf by leaf, one
  small program per distinct shape and dtype (one program for the whole tree compiled for minutes
  on a GPU at ~350M)."""
  import jax

  leaves, treedef = jax.tree.flatten(shapes)
  keys = jax.random.split(key, len(leaves))
  return treedef.unflatten([_normal(tuple(x.shape), x.dtype)(k, std) for k, x in zip(keys, leaves)])


@functools.cache
def _normal(shape: tuple, dtype):
  import jax

  return jax.jit(lambda key, std: jax.random.normal(key, shape, dtype) * std)


def variant(config, pattern: str, kda_tiles: str = ''):
  """(model, model config) of `config` with layer_pattern = pattern and, unless kda_tiles is '',
  model.kernels.kda = kda_tiles; validated."""
  from kimijax.config import validate
  from kimijax.model import Transformer

  config = config.copy_and_resolve_references()
  config.model.layer_pattern = pattern
  if kda_tiles:
    config.model.kernels.kda = kda_tiles
  m = validate(config).model
  return Transformer(m), m


def build(config, pattern: str):
  """(model, weights, model config) of `config` with layer_pattern = pattern: random parameters of
  the model's shapes (N(0, 0.02); matrices in the compute dtype, the rest float32), with the MoE
  biases (zero) for a model with MoE layers (kimijax.model.inference_variables). The shapes come
  from tracing the model's init, not compiling it (that compile took longer than the benchmark's
  steps at ~350M)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from kimijax.model import inference_variables

  model, m = variant(config, pattern)
  shapes = nn.unbox(jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 1), jnp.int32)))
  as_weight = lambda x: jax.ShapeDtypeStruct(x.shape, m.compute_dtype if x.ndim > 1 else jnp.float32)
  params = random_like(jax.tree.map(as_weight, shapes['params']), jax.random.key(0), 0.02)
  moe_state = shapes.get('moe_state')
  if moe_state is not None:
    moe_state = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), moe_state)
  return model, inference_variables(params, moe_state), m


def step_bytes(m, params, cache: dict, batch: int) -> int:
  """Bytes one decode step must read: the parameters (an untied input embedding only `batch` rows),
  each attention layer's cache, each KDA layer's cache twice (its state and conv states are read
  and written)."""
  from kimijax import config as config_lib
  from kimijax.infer.cache import cache_bytes
  from kimijax.model import as_variables

  weights = as_variables(params)['params']
  total = cache_bytes(weights)
  if not m.tie_embeddings:
    embed = weights['embed']
    total -= (embed.shape[0] - batch) * embed.shape[1] * embed.dtype.itemsize
  for i, kind in enumerate(config_lib.layer_kinds(m)):
    total += (2 if kind == 'K' else 1) * cache_bytes(cache[f'layer_{i}'])
  return total


def bench(model, params, m, context: int, batch: int, steps: int, bandwidth: float, profile: str | None = None) -> dict:
  """The step's and the loop's times at `context`, the cache's size and the step's roofline; with
  `profile` (a directory), a trace of PROFILE_STEPS more steps there."""
  import jax
  import jax.numpy as jnp

  from experiments.bench import timing
  from kimijax.infer.cache import cache_bytes, init_cache
  from kimijax.infer.generate import decode
  from kimijax.model import as_variables, count_params

  # as if L - 1 tokens had been seen; no zero-filled copy first
  cache = random_like(jax.eval_shape(lambda: init_cache(m, batch, context)), jax.random.key(1), 0.1)
  read = step_bytes(m, params, cache, batch)

  @functools.partial(jax.jit, donate_argnames='cache')  # as in kimijax.infer.generate: in place
  def step(params, token, cache):
    logits, aux = model.apply(as_variables(params), token[:, None], jnp.full((batch, 1), context - 1), cache=cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), aux['cache']

  token = jnp.zeros((batch,), jnp.int32)
  # Each step rewrites position L - 1: a steady-state step at context L; the warm-up compiles.
  ms, (token, cache) = timing.loop_ms(lambda carry: step(params, *carry), (token, cache), steps=steps)
  if profile:
    with jax.profiler.trace(profile, create_perfetto_trace=True):
      _, (token, cache) = timing.loop_ms(
        lambda carry: step(params, *carry), (token, cache), steps=PROFILE_STEPS, warmup=0
      )

  prompt = jnp.zeros((batch, context - steps - 1), jnp.int32)
  logits, rng = jnp.zeros((batch, m.vocab_size), jnp.float32), jax.random.key(0)

  def loop(cache):
    return decode(model, params, prompt, logits, cache, rng, max_new_tokens=steps + 1, temperature=0.0)[1]

  loop_ms, cache = timing.loop_ms(loop, cache, steps=LOOP_CALLS)
  roofline_ms = read / bandwidth * 1e3
  return {
    'ms_per_token': ms,
    'tokens_per_sec': batch / ms * 1e3,
    'loop_ms_per_token': loop_ms / steps,
    'params_M': count_params(as_variables(params)['params']) / 1e6,
    'cache_MiB_per_seq': cache_bytes(cache) / batch / 2**20,
    'read_MiB': read / 2**20,
    'roofline_ms': roofline_ms,
    'step_over_roofline': ms / roofline_ms,
    'loop_over_roofline': loop_ms / steps / roofline_ms,
  }


def row(context: int, pattern: str, r: dict, speedup: str = '') -> str:
  cells = (
    f'{context}',
    f'{pattern}',
    f'{r["params_M"]:.1f}',
    f'{r["ms_per_token"]:.3f}',
    f'{r["tokens_per_sec"]:,.1f}',
    f'{r["loop_ms_per_token"]:.3f}',
    f'{r["cache_MiB_per_seq"]:.2f}',
    f'{r["read_MiB"]:,.1f}',
    f'{r["roofline_ms"]:.3f}',
    f'{r["step_over_roofline"]:.2f}',
    f'{r["loop_over_roofline"]:.2f}',
    speedup,
  )
  return '| ' + ' | '.join(cells) + ' |'


def flag_error(contexts: list[str], steps: int, copy_gib: float, kda_tiles: tuple[str, ...] = ('',)) -> str | None:
  """The message for a bad flag, else None."""
  from kernels_pallas.kda.settings import KdaSettings

  for text in kda_tiles:
    try:
      KdaSettings.from_string(text)
    except ValueError as e:
      return f'--kda_tiles={text!r}: {e}'
  if steps < 1:
    return f'--steps={steps} must be >= 1'
  if copy_gib <= 0:
    return f'--copy_gib={copy_gib} must be positive'
  if bad := [c for c in contexts if not c.isdigit()]:
    return f'--contexts: {bad} are not whole numbers'
  if short := [c for c in contexts if int(c) < steps + 2]:
    return f'--contexts: {short} leave no prompt for the loop: each must be at least --steps + 2 = {steps + 2}'
  return None


def table(
  config,
  contexts: list[int],
  batch: int,
  steps: int,
  hybrid: str,
  baseline: str,
  copy_gib: float,
  profile_dir: str | None = None,
  kda_tiles: tuple[str, ...] = ('',),
):
  """The Markdown lines: the setup and the measured copy bandwidth, the header, then per context a
  row of the baseline (none where baseline is '') and one of the hybrid for each kda_tiles entry
  (labelled with it unless ''), each yielded as soon as it is measured; with `profile_dir`, each
  model's steps at each context traced to PROFILE_DIR/hybrid_CONTEXT (the entries after the first:
  hybrid1_CONTEXT, ...) and PROFILE_DIR/baseline_CONTEXT."""
  from experiments.bench import timing

  bandwidth = timing.copy_bytes_per_s(int(copy_gib * 2**30))
  models = {}
  if baseline:
    baseline_model, baseline_params, baseline_m = build(config, baseline)
    models[baseline] = (baseline_model, baseline_m, baseline_params, 'baseline')
  hybrid_model, hybrid_params, hybrid_m = build(config, hybrid)
  for i, text in enumerate(kda_tiles):  # the same parameters under each entry's kernel settings
    label = f'{hybrid} (kda {text})' if text else hybrid
    model, m = variant(config, hybrid, text) if text else (hybrid_model, hybrid_m)
    models[label] = (model, m, hybrid_params, f'hybrid{i or ""}')
  yield (
    f'batch {batch}; {steps} timed steps, {LOOP_CALLS} loop calls of {steps} steps; compute dtype '
    f'{config.model.compute_dtype}; MLA decode {config.model.mla_decode_impl} {config.model.kernels.mla_decode!r}; '
    f'copy bandwidth {bandwidth / 1e9:,.1f} GB/s ({copy_gib:g} GiB, read + write)'
  )
  yield ''
  yield HEADER
  yield '|' + '---|' * HEADER.count(' | ') + '---|'
  for context in contexts:
    base = None
    for label, (model, m, params, role) in models.items():  # the baseline first
      trace = profile_dir and f'{profile_dir}/{role}_{context}'
      r = bench(model, params, m, context, batch, steps, bandwidth, trace)
      speedup = ''
      if role == 'baseline':
        base = r
      elif base is not None:
        speedup = f'{base["ms_per_token"] / r["ms_per_token"]:.2f}x ({base["read_MiB"] / r["read_MiB"]:.2f}x)'
      yield row(context, label, r, speedup)


def main(argv):
  del argv
  from experiments import runs
  from experiments.cli import user_errors
  from kimijax.config import config_from_flags

  with user_errors():
    config = config_from_flags('config')
  if message := flag_error(FLAGS.contexts, FLAGS.steps, FLAGS.copy_gib, tuple(FLAGS.kda_tiles)):
    usage_error(message)
  hybrid = FLAGS.hybrid_pattern or config.model.layer_pattern
  contexts = [int(c) for c in FLAGS.contexts]
  runs.print_header()
  for line in table(
    config,
    contexts,
    FLAGS.batch,
    FLAGS.steps,
    hybrid,
    FLAGS.baseline_pattern,
    FLAGS.copy_gib,
    FLAGS.profile_dir,
    tuple(FLAGS.kda_tiles),
  ):
    print(line, flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
