"""Block AttnRes op timings: phase 1 (kimijax.ops.attnres.phase1) and phase 2 with the consumer's
pre-norm (merge_partial then RMSNorm in XLA, or fused: kimijax.ops.attnres.merge_norm).

    python -m experiments.bench.bench_attnres                            # GPU: the bench_350m shape
    python -m experiments.bench.bench_attnres --batch=1 --seq_len=256 --sources=2   # CPU (pallas interpreted)

Phase 1 of one block: S queries over n block sums (random bf16 sources [B, T, D] of different
scales, random queries), forward (the S outputs and lse) and forward+backward (a random projection
of the outputs, lse and the passed-through sources, and its gradients with respect to the sources
and queries), for each impl and each n in --sources. Also phase 2 and the pre-norm of one consumer,
unfused ('xla') and fused ('pallas', and the --merge_tiles variants), by default after adding the
previous sublayer's output to the partial sum (--merge_add). For scale, the time of one pass over a
[B, T, D] array (from chained scale-and-copies, a read and a write each), so each figure can be read
as passes; the figures include each call's launch overhead, the pass time does not.
Before timing, each impl's outputs and gradients are checked against impl 'xla' in float32.
Each figure is the median of --repeats timed calls after --warmup calls; prints a Markdown table.
"""

from absl import app, flags

from experiments import runs

flags.DEFINE_integer('batch', 16, 'B')
flags.DEFINE_integer('seq_len', 4096, 'T')
flags.DEFINE_integer('d_model', 1024, 'D')
flags.DEFINE_integer('queries', 6, 'S, consumers per block')
flags.DEFINE_list('sources', ['2', '5', '9'], 'n, block sums seen by the block')
flags.DEFINE_list('impls', ['xla', 'pallas'], 'phase-1 impls to time')
flags.DEFINE_string('dtype', 'bfloat16', 'source dtype')
flags.DEFINE_list(
  'pallas_tiles',
  [],
  "extra Pallas tile settings to time, each 'key=value/key=value' "
  'over the fields of kernels_pallas.attnres.settings.Phase1Settings (e.g. bt=32/warps=8)',
)
flags.DEFINE_list(
  'merge_tiles',
  [],
  'extra tile settings of the fused phase-2 kernels to time '
  '(the fields of kernels_pallas.attnres.settings.MergeNormSettings)',
)
flags.DEFINE_bool(
  'merge_add',
  True,
  'phase 2 also adds the previous sublayer output to the partial '
  'sum first, as the model does with the Pallas kernels and no remat',
)
flags.DEFINE_bool(
  'per_kernel',
  False,
  "also print each kernel's device time per forward call and per "
  'forward+backward call (from profiler traces; GPU only: the CPU has none)',
)
flags.DEFINE_integer('repeats', 10, 'timed calls per figure')
flags.DEFINE_integer('warmup', 2, 'untimed calls first (the first compiles)')
FLAGS = flags.FLAGS


def _time(fn, *args):
  from experiments.bench import timing

  return timing.call_ms(lambda: fn(*args), repeats=FLAGS.repeats, warmup=FLAGS.warmup)[0]


def _kernel_ms(fn, *args, calls=5):
  """[(kernel name, device ms per call)], longest first, from a profiler trace of `calls` calls."""
  import gzip
  import json
  import tempfile

  import jax

  from experiments.tools.profile_summary import device_events, newest_trace, summarise

  jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fn(*args))
    with gzip.open(newest_trace(trace_dir)) as f:
      return summarise(device_events(json.load(f)), calls)[1]


def _print_kernels(label, forward, backward, args, backward_args, pass_ms):
  """The attnres kernels' device time per forward call and per forward+backward call, and the
  other ops' summed. (The phase-1 gradient needs no phase-1 outputs, so its combine kernel shows
  in the forward only.)"""
  if not FLAGS.per_kernel:
    return
  for kind, fn, fn_args in (('fwd', forward, args), ('fwd+bwd', backward, backward_args)):
    times = _kernel_ms(fn, *fn_args)
    ours = [(name, ms) for name, ms in times if name.startswith('attnres')]
    rest = sum(ms for name, ms in times if not name.startswith('attnres'))
    print(
      f'|   {label} {kind}: '
      + ', '.join(f'{name} {ms:.3f} ({ms / pass_ms:.1f})' for name, ms in ours)
      + f'; other ops {rest:.3f} |',
      flush=True,
    )


def _inputs(n, s, dtype, key=0):
  import jax

  keys = jax.random.split(jax.random.key(key), n + 3)
  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.d_model)
  sources = tuple((jax.random.normal(keys[i], shape) * (1 + i)).astype(dtype) for i in range(n))
  queries = 0.05 * jax.random.normal(keys[n], (s, FLAGS.d_model))
  return sources, queries, keys[n + 1], keys[n + 2]


def _settings(impl, settings_type):
  """'pallas:bt=32/warps=8' -> settings_type with bt=32, warps=8 (the other fields the defaults)."""
  return settings_type.from_string(impl.split(':')[1])


def _phase1_fns(impl):
  """impl: 'xla', 'pallas', or 'pallas:<tiles>' (the kernels with those tiles)."""
  import jax
  import jax.numpy as jnp

  from kernels_pallas.common import kernels_interpreted
  from kimijax.ops.attnres import phase1 as ops_phase1

  def phase1(v, q, impl):
    if ':' not in impl:
      return ops_phase1(v, q, impl=impl)
    from kernels_pallas.attnres.phase1 import phase1 as kernel
    from kernels_pallas.attnres.settings import Phase1Settings

    return kernel(v, q, settings=_settings(impl, Phase1Settings), interpret=kernels_interpreted())

  def loss(sources, queries, w_outs, w_lse):
    # The sources as passed through count too: in the model, later blocks use them.
    outs, lse, sources = phase1(sources, queries, impl=impl)
    return sum(jnp.sum(o.astype(jnp.float32) * w_outs) for o in outs + sources) + jnp.sum(lse * w_lse)

  forward = jax.jit(lambda v, q: phase1(v, q, impl=impl))
  backward = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  return forward, backward


def _check(impl, n, s):
  """Max relative error of impl against 'xla' at float32, forward and gradients."""
  import jax
  import jax.numpy as jnp

  sources, queries, k1, k2 = _inputs(n, s, jnp.float32, key=1)
  shape = sources[0].shape
  w_outs, w_lse = jax.random.normal(k1, shape), jax.random.normal(k2, (s,) + shape[:-1])
  with jax.default_matmul_precision('highest'):
    got = [
      f(sources, queries) if i == 0 else f(sources, queries, w_outs, w_lse) for i, f in enumerate(_phase1_fns(impl))
    ]
    want = [
      f(sources, queries) if i == 0 else f(sources, queries, w_outs, w_lse) for i, f in enumerate(_phase1_fns('xla'))
    ]
  return _max_rel_err(got, want)


def _max_rel_err(got, want):
  """The largest max-abs error relative to the reference's max-abs, over the pytrees' leaves."""
  import jax
  import jax.numpy as jnp

  return max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
  )


def _merge_inputs(dtype, key=5):
  """Phase-2 inputs (o, lse, p, q, RMSNorm gain, and with --merge_add the sublayer output y to add
  to p first) and a random cotangent for the normalised input."""
  import jax

  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.d_model)
  k = jax.random.split(jax.random.key(key), 7)
  o, p, y = (jax.random.normal(k[i], shape).astype(dtype) for i in (0, 1, 6))
  lse = jax.random.normal(k[2], shape[:-1])
  q = 0.05 * jax.random.normal(k[3], shape[-1:])
  scale = 1 + 0.1 * jax.random.normal(k[4], shape[-1:])
  return (o, lse, p, q, scale) + ((y,) if FLAGS.merge_add else ()), jax.random.normal(k[5], shape)


def _merge_fns(impl):
  """Phase 2 and the consumer's pre-norm: 'xla' unfused (merge_partial, then the RMSNorm
  formula), 'pallas' the fused kernels (kimijax.ops.attnres.merge_norm), 'pallas:<tiles>' them
  with those tiles; with --merge_add, after adding y to p (an XLA add, or in the kernel). Forward,
  and the gradient of a random projection of the normalised input plus the partial sum (its next
  use in the model; the projection's read counts too)."""
  import jax
  import jax.numpy as jnp

  from kernels_pallas.common import kernels_interpreted
  from kimijax.layers.norms import rms_normalise
  from kimijax.ops.attnres import merge_norm, merge_partial

  def fn(o, lse, p, q, scale, y=None):
    """-> (normalised input, the partial sum for its next use)."""
    if impl == 'xla':
      p = p if y is None else p + y
      return (rms_normalise(merge_partial(o, lse, p, q), 1e-6) * scale).astype(o.dtype), p
    if impl == 'pallas':
      return merge_norm(o, lse, p, q, scale, dtype=o.dtype, addend=y, impl='pallas')
    from kernels_pallas.attnres.merge_norm import merge_norm as kernel
    from kernels_pallas.attnres.settings import MergeNormSettings

    return kernel(
      o,
      lse,
      p,
      q,
      scale,
      eps=1e-6,
      norm_eps=1e-6,
      dtype=o.dtype,
      addend=y,
      settings=_settings(impl, MergeNormSettings),
      interpret=kernels_interpreted(),
    )

  def loss(*args):
    x, p = fn(*args[:-1])
    return jnp.sum((x.astype(jnp.float32) + p.astype(jnp.float32)) * args[-1])

  return jax.jit(fn), jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6 if FLAGS.merge_add else 5))))


def _check_merge(impl):
  """Max relative error of a fused phase 2 against 'xla' at float32, forward and gradients."""
  import jax
  import jax.numpy as jnp

  args, w = _merge_inputs(jnp.float32, key=1)
  with jax.default_matmul_precision('highest'):
    got = [f(*args) if i == 0 else f(*args, w) for i, f in enumerate(_merge_fns(impl))]
    want = [f(*args) if i == 0 else f(*args, w) for i, f in enumerate(_merge_fns('xla'))]
  return _max_rel_err(got, want)


def main(_):
  import jax
  import jax.numpy as jnp

  dtype = jnp.dtype(FLAGS.dtype)
  s = FLAGS.queries
  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.d_model)
  runs.print_header()
  print(f'AttnRes phase 1 / phase 2: B={FLAGS.batch} T={FLAGS.seq_len} D={FLAGS.d_model} S={s} {FLAGS.dtype}\n')
  x = jnp.ones(shape, dtype)
  scales = 20  # in one call, so that the launch overhead does not count
  loop_ms = _time(jax.jit(lambda a: jax.lax.fori_loop(0, scales, lambda i, y: y * 1.5, a)), x)
  pass_ms = loop_ms / (2 * scales)
  print(
    f'one pass over [B, T, D] ({x.nbytes / 2**20:.0f} MiB): {pass_ms:.3f} ms '
    f'(from {scales} chained scale-and-copies in {loop_ms:.2f} ms)\n'
  )
  print('| op | impl | n | check (max rel err vs xla, f32) | forward ms (passes) | fwd+bwd ms (passes) |')
  print('|---|---|---|---|---|---|')
  for n in map(int, FLAGS.sources):
    for impl in FLAGS.impls + [f'pallas:{t}' for t in FLAGS.pallas_tiles]:
      err = _check(impl, n, s) if impl != 'xla' else 0.0
      sources, queries, k1, k2 = _inputs(n, s, dtype)
      forward, backward = _phase1_fns(impl)
      w_outs, w_lse = jax.random.normal(k1, shape), jax.random.normal(k2, (s,) + shape[:-1])
      f_ms = _time(forward, sources, queries)
      b_ms = _time(backward, sources, queries, w_outs, w_lse)
      print(
        f'| phase1 | {impl} | {n} | {err:.1e} | {f_ms:.2f} ({f_ms / pass_ms:.1f}) | '
        f'{b_ms:.2f} ({b_ms / pass_ms:.1f}) |',
        flush=True,
      )
      _print_kernels(
        f'phase 1 {impl} n={n}', forward, backward, (sources, queries), (sources, queries, w_outs, w_lse), pass_ms
      )
  for impl in ['xla', 'pallas'] + [f'pallas:{t}' for t in FLAGS.merge_tiles]:
    err = _check_merge(impl) if impl != 'xla' else 0.0
    args, w = _merge_inputs(dtype)
    forward, backward = _merge_fns(impl)
    f_ms = _time(forward, *args)
    b_ms = _time(backward, *args, w)
    print(
      f'| phase 2 + pre-norm | {impl} | - | {err:.1e} | {f_ms:.2f} ({f_ms / pass_ms:.1f}) | '
      f'{b_ms:.2f} ({b_ms / pass_ms:.1f}) |',
      flush=True,
    )
    _print_kernels(f'phase 2 {impl}', forward, backward, args, (*args, w), pass_ms)


if __name__ == '__main__':
  app.run(main)
