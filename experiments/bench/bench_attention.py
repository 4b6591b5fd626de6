"""Attention op timings: 'tokamax' against 'cudnn' (+ its max-logit kernel) and 'xla', with and
without max logits, forward and forward+backward, side by side in one process (issue 16).

    python -m experiments.bench.bench_attention                      # one H200: every shape below
    python -m experiments.bench.bench_attention --shapes=mha_4k,mla_4k --impls=tokamax,cudnn
    python -m experiments.bench.bench_attention --shapes=2x64x64x2x2x16x16 --impls=xla   # CPU smoke

Shapes (B, T, S, H, Hkv, D, Dv), causal, queries the last T of S positions: mha_4k (8, 4096, 4096,
16, 16, 128, 128), mha_16k (2, 16384, ...), gqa_4k (16 query / 4 key-value heads), mla_4k (q/k 192,
v 128: 'cudnn' pads v to 192, 'tokamax' takes it as it is), decode_4k (T = 1 over a full 4096
cache, forward only; 'xla' there is decode_attention, the path generation uses), or any
'BxTxSxHxHkvxDxDv'. Every cell runs kimijax.ops.attention.attention (or decode_attention) jitted:
forward returns the output (and the max logits), forward+backward sum(out * do) and its gradients
with respect to q, k and v (and the max logits), so no requested work is dropped.
A cell is the median (min) of --repeats calls in ms after --warmup calls, with the forward's
TFLOP/s (2 B H (D + Dv) x unmasked (query, key) pairs); 'xla' is skipped above
--skip_xla_above keys (it writes the [T, S] logits), and out of memory or a kernel's refusal
is a cell, not a crash. Prints a Markdown table.

Figures on an H200: experiments/results/bench_attention.md, with the step comparisons it
lists (experiments/bench/bench_compare.py: bench_350m and its 3:1 KDA:MLA hybrid, 'tokamax'
against 'cudnn', with and without max logits).
"""

SHAPES = {  # name: (B, T, S, H, Hkv, D, Dv)
  'mha_4k': (8, 4096, 4096, 16, 16, 128, 128),
  'mha_16k': (2, 16384, 16384, 16, 16, 128, 128),
  'gqa_4k': (8, 4096, 4096, 16, 4, 128, 128),
  'mla_4k': (8, 4096, 4096, 16, 16, 192, 128),
  'decode_4k': (8, 1, 4096, 16, 16, 128, 128),
}
IMPLS = ('tokamax', 'cudnn', 'xla')


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  from absl import flags

  flags.DEFINE_list('shapes', list(SHAPES), f"shape names ({', '.join(SHAPES)}) or 'BxTxSxHxHkvxDxDv'")
  flags.DEFINE_list('impls', list(IMPLS), 'attention implementations to time')
  flags.DEFINE_string('dtype', None, 'input dtype; default bfloat16 on a GPU, float32 elsewhere')
  flags.DEFINE_integer('repeats', 10, 'timed calls per cell')
  flags.DEFINE_integer('warmup', 2, 'untimed calls first (the first compiles)')
  flags.DEFINE_integer('skip_xla_above', 8192, "skip 'xla' when S exceeds this (its [T, S] logits)")


def parse_shape(name: str) -> tuple[int, ...]:
  if name in SHAPES:
    return SHAPES[name]
  parts = name.split('x')
  if len(parts) != 7 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f'--shapes entry {name!r} is neither a name ({", ".join(SHAPES)}) nor BxTxSxHxHkvxDxDv')
  return tuple(int(p) for p in parts)


def forward_tflop(shape) -> float:
  """Forward TFLOP of causal attention: 2 (D + Dv) multiply-adds per unmasked (query, key) pair."""
  b, t, s, h, _, d, dv = shape
  pairs = t * (s - t) + t * (t + 1) // 2
  return 2.0 * b * h * pairs * (d + dv) / 1e12


def _error_cell(e: Exception) -> str:
  text = str(e)
  if 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower():
    return 'out of memory'
  return f'failed: {type(e).__name__}: {text.splitlines()[0][:80] if text else ""}'


def _cells(shape, impl, max_logits, dtype, repeats, warmup):
  """[forward, forward+backward] cells of one row."""
  import jax
  import jax.numpy as jnp

  from experiments.bench import timing
  from kimijax.ops import attention as attention_ops

  b, t, s, h, hkv, d, dv = shape
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k = jax.random.normal(keys[1], (b, s, hkv, d), dtype)
  v = jax.random.normal(keys[2], (b, s, hkv, dv), dtype)
  do = jax.random.normal(keys[3], (b, t, h, dv), dtype)
  if t == 1 and impl == 'xla':  # the decoding path over a cache (here full: length S)
    op = lambda q, k, v: attention_ops.decode_attention(q, k, v, s)
  else:
    op = lambda q, k, v: attention_ops.attention(q, k, v, causal=True, impl=impl, return_max_logits=max_logits)

  def loss(q, k, v):
    result = op(q, k, v)
    out, m = result if max_logits else (result, None)
    return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), m

  fns = [(jax.jit(op), forward_tflop(shape))]
  if t > 1:
    fns.append((jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)), None))
  cells = []
  for fn, tflop in fns:
    try:
      median, best = timing.call_ms(lambda fn=fn: fn(q, k, v), repeats=repeats, warmup=warmup)
      cells.append(f'{median:.2f} ({best:.2f})' + (f', {tflop / median * 1e3:.3g} TFLOP/s' if tflop else ''))
    except Exception as e:  # noqa: BLE001 - out of memory, a shape a kernel refuses
      cells.append(_error_cell(e))
  return cells + ['-'] * (2 - len(cells))


def rows(shape_names, impls, dtype_name=None, repeats=10, warmup=2, skip_xla_above=8192):
  """Yields the table's rows (lists of cells), each as soon as it is timed."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import attention as attention_ops

  dtype = jnp.dtype(dtype_name or ('bfloat16' if jax.default_backend() == 'gpu' else 'float32'))
  for name in shape_names:
    shape = parse_shape(name)
    label = name if name in SHAPES else 'custom'
    shape_text = f'{label} ({", ".join(map(str, shape))})'
    for impl in impls:
      if impl not in attention_ops.IMPLS:
        raise ValueError(f'--impls entry {impl!r} is unknown; allowed: {tuple(attention_ops.IMPLS)}')
      for max_logits in (False,) if shape[1] == 1 else (False, True):
        what = impl + (' + max-logit kernel' if impl == 'cudnn' and max_logits else '')
        if shape[1] == 1 and impl == 'xla':
          what = 'xla (decode_attention)'
        problem = attention_ops.unsupported(impl, dtype)
        if problem:
          cells = ['n/a: needs ' + problem.split(';')[0].split(' needs ', 1)[-1]] * 2
        elif impl == 'xla' and shape[2] > skip_xla_above:
          cells = [f'skipped (S > --skip_xla_above={skip_xla_above})'] * 2
        else:
          cells = _cells(shape, impl, max_logits, dtype, repeats, warmup)
        yield [shape_text, what, 'yes' if max_logits else ('-' if shape[1] == 1 else 'no'), *cells]


def header_packages(impls) -> list[str]:
  """The optional packages that --impls runs, for the header: tokamax for 'tokamax', and for 'gpu',
  which runs tokamax where it returns the max logits (kimijax.ops.attention.gpu_choice)."""
  return ['tokamax'] if {'tokamax', 'gpu'} & set(impls) else []


def main(argv):
  del argv
  from absl import flags

  from experiments import runs

  FLAGS = flags.FLAGS
  runs.print_header(header_packages(FLAGS.impls))
  print(
    f'causal; median (min) of {FLAGS.repeats} calls in ms after {FLAGS.warmup}; forward TFLOP/s over unmasked pairs\n'
  )
  print('| shape (B, T, S, H, Hkv, D, Dv) | implementation | max logits | forward ms | forward+backward ms |')
  print('|---|---|---|---|---|', flush=True)
  for row in rows(FLAGS.shapes, FLAGS.impls, FLAGS.dtype, FLAGS.repeats, FLAGS.warmup, FLAGS.skip_xla_above):
    print('| ' + ' | '.join(row) + ' |', flush=True)


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
