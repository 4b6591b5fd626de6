"""MLA decoding over the cached latents (kimijax/ops/mla_decode.py): the op alone, 'pallas' (the
split-context kernel) against 'xla', against the memory roofline.

    python -m experiments.bench.bench_mla_decode                      # one H200: the shapes below
    python -m experiments.bench.bench_mla_decode --contexts=131072 --rope_dims=64 --tiles=block_s=32/warps=8
    python -m experiments.bench.bench_mla_decode --batch=2 --heads=4 --rank=64 --rope_dims=16,0 \
        --contexts=96 --copy_mib=16 --repeats=1 --warmup=1      # CPU smoke ('pallas' interpreted)

At --batch=16 sequences, --heads=8 query heads, latent rank --rank=512 and --rope_dims=64,0
decoupled dims, for each context L in --contexts (4096, 32768, 131072; the cache holds L positions
and every sequence attends to all of them, length = L), in bf16 on a GPU (float32 elsewhere), from
random inputs: ms per call (the mean of --repeats calls queued back to back, after --warmup), GB/s
over the bytes the op must read (the latents and k_rope of the B L positions, once: B L (r + dr)
times the item size; the queries and the output are under 0.1% of it at 4096), and that as a
fraction of the copy bandwidth measured in the same run (experiments/bench/timing.py
copy_bytes_per_s: a jitted, donated x + 1 over --copy_mib MiB, read and written); each impl's
relative RMSE against 'xla' in float32 (at the highest matmul precision, over the same inputs), and
its speed-up over 'xla'. --tiles sets the kernel's MlaDecodeSettings ('key=int/key=int',
kernels_pallas/mla_decode/settings.py). Prints
Markdown; results go to experiments/results/.
"""

CONTEXTS = ('4096', '32768', '131072')
IMPLS = ('pallas', 'xla')


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  from absl import flags

  flags.DEFINE_list('contexts', list(CONTEXTS), 'cache positions L (every sequence attends to all of them)')
  flags.DEFINE_integer('batch', 16, 'sequences decoded together')
  flags.DEFINE_integer('heads', 8, 'query heads H')
  flags.DEFINE_integer('rank', 512, 'latent rank r (kv_lora_rank)')
  flags.DEFINE_list('rope_dims', ['64', '0'], 'decoupled dims dr (0: none)')
  flags.DEFINE_list('impls', list(IMPLS), 'implementations (kimijax.ops.mla_decode.IMPLS)')
  flags.DEFINE_string('tiles', '', "the kernel's settings, 'key=int/key=int' ('': the defaults)")
  flags.DEFINE_string('dtype', None, 'cache and query dtype; default bfloat16 on a GPU, float32 elsewhere')
  flags.DEFINE_integer('copy_mib', 2048, 'MiB of the copy that measures the bandwidth')
  flags.DEFINE_integer('repeats', 20, 'timed calls per cell')
  flags.DEFINE_integer('warmup', 2, 'untimed calls first (the first compiles)')


def bytes_read(batch: int, context: int, rank: int, rope_dim: int, itemsize: int) -> int:
  """The bytes decoding must read: each sequence's latents and k_rope up to its length, once."""
  return batch * context * (rank + rope_dim) * itemsize


def flag_error(contexts: list[str], rope_dims: list[str], tiles: str, dtype: str | None, copy_mib: int) -> str | None:
  """The message for a bad flag, else None."""
  from kimijax.ops import mla_decode as ops

  for name, values in (('contexts', contexts), ('rope_dims', rope_dims)):
    if bad := [v for v in values if not v.isdigit()]:
      return f'--{name}: {bad} are not whole numbers'
  if any(int(c) < 1 for c in contexts):
    return f'--contexts={",".join(contexts)}: every context must be >= 1'
  if copy_mib < 1:
    return f'--copy_mib={copy_mib} must be >= 1'
  if dtype is not None and dtype not in ('bfloat16', 'float16', 'float32'):
    return f"--dtype={dtype!r} is not one of 'bfloat16', 'float16', 'float32'"
  try:
    ops.IMPLS['pallas'].parse_settings(tiles)
  except ValueError as e:
    return f'--tiles={tiles!r}: {e}'
  return None


def rows(
  contexts,
  impls,
  *,
  copy_gbs,
  batch=16,
  heads=8,
  rank=512,
  rope_dims=(64, 0),
  tiles='',
  dtype_name=None,
  repeats=20,
  warmup=2,
):
  """Yields the table's rows: [dr, context, impl, ms, GB/s, fraction of copy_gbs, rel. RMSE vs xla, speed-up
  over xla (its ms / this impl's)]."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from experiments.bench import timing
  from kimijax.ops import mla_decode as ops

  dtype = jnp.dtype(dtype_name or ('bfloat16' if jax.default_backend() == 'gpu' else 'float32'))
  settings = ops.IMPLS['pallas'].parse_settings(tiles)
  scale = (128 + 64) ** -0.5
  for dr in rope_dims:
    for context in contexts:
      ks = jax.random.split(jax.random.key(context + dr), 4)
      args = [
        jax.random.normal(ks[0], (batch, heads, rank), dtype),
        jax.random.normal(ks[1], (batch, heads, dr), dtype) if dr else None,
        jax.random.normal(ks[2], (batch, context, rank), dtype),
        jax.random.normal(ks[3], (batch, context, dr), dtype) if dr else None,
      ]
      length = jnp.full((batch,), context, jnp.int32)
      with jax.default_matmul_precision('highest'):
        f32 = [None if a is None else a.astype(jnp.float32) for a in args]
        ref = np.asarray(jax.jit(lambda *a: ops.mla_decode(*a, length, scale=scale))(*f32), np.float64)
        del f32
      read = bytes_read(batch, context, rank, dr, dtype.itemsize)
      cells = {}
      for impl in impls:
        fn = jax.jit(
          lambda *a, impl=impl: ops.mla_decode(
            *a, length, scale=scale, impl=impl, settings=settings if impl == 'pallas' else None
          )
        )
        try:
          ms = timing.queued_ms(lambda fn=fn: fn(*args), repeats=repeats, warmup=warmup)
          out = np.asarray(fn(*args).astype(jnp.float32), np.float64)
        except Exception as e:  # noqa: BLE001 - out of memory, a shape a kernel refuses
          cells[impl] = (None, [f'failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}', '', '', ''])
          continue
        gbs = read / ms / 1e6
        rmse = float(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref**2)))
        cells[impl] = (ms, [f'{ms:.3f}', f'{gbs:.3g}', f'{gbs / copy_gbs:.2f}', f'{rmse:.1e}'])
      xla_ms = cells.get('xla', (None,))[0]
      for impl, (ms, cell) in cells.items():
        speedup = f'{xla_ms / ms:.2f}x' if ms and xla_ms else '-'
        yield [str(dr), str(context), impl, *cell, speedup]
      args = None  # the cache's memory back before the next shape's


def main(argv):
  del argv
  from absl import flags

  from experiments import runs
  from experiments.bench import timing
  from experiments.cli import usage_error

  FLAGS = flags.FLAGS
  if message := flag_error(FLAGS.contexts, FLAGS.rope_dims, FLAGS.tiles, FLAGS.dtype, FLAGS.copy_mib):
    usage_error(message)
  runs.print_header()
  copy_gbs = timing.copy_bytes_per_s(FLAGS.copy_mib * 2**20) / 1e9
  print(
    f'batch {FLAGS.batch}, {FLAGS.heads} heads, rank {FLAGS.rank}; settings {FLAGS.tiles or "defaults"}; mean of '
    f'{FLAGS.repeats} queued calls after {FLAGS.warmup}; copy bandwidth {copy_gbs:.0f} GB/s '
    f'(a donated x + 1 over {FLAGS.copy_mib} MiB)\n'
  )
  print(
    '| dr | context | impl | ms per call | GB/s read | of copy bandwidth | rel. RMSE vs xla (float32) | '
    'speed-up over xla |'
  )
  print('|---|---|---|---|---|---|---|---|', flush=True)
  for row in rows(
    [int(c) for c in FLAGS.contexts],
    FLAGS.impls,
    batch=FLAGS.batch,
    heads=FLAGS.heads,
    rank=FLAGS.rank,
    rope_dims=[int(d) for d in FLAGS.rope_dims],
    tiles=FLAGS.tiles,
    dtype_name=FLAGS.dtype,
    copy_gbs=copy_gbs,
    repeats=FLAGS.repeats,
    warmup=FLAGS.warmup,
  ):
    print('| ' + ' | '.join(row) + ' |', flush=True)


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
