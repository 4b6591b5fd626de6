"""KDA op timings: forward and forward+backward of every kimijax.ops.kda implementation.

    python -m experiments.bench.bench_kda                             # GPU, the benchmark shape B=8 T=4096 H=16 D=128
    python -m experiments.bench.bench_kda --batch=1 --seq_len=2048 --heads=2 --head_dim=64 --dtype=float32   # CPU

Times kimijax's implementations ('xla_recurrent', 'xla', 'pallas': --impls) on random
inputs of one shape (q, k L2-normalised; g = -exp(U(-7, --gate_log_max)), by default 0.5: the
range of the KDA gate at init, where no 16-token sub-chunk is steep; beta = sigmoid(N(0, 1))).
--gate_log_max=3 makes nearly every sub-chunk steep (its decay drops by 60 or more in some
feature), which the Pallas kernels form with their pairwise diagonal kernels instead of matmuls
(kernels_pallas/kda/README.md, Stability): the slow path's cost. forward: o from (q, k, v, g,
beta); forward+backward: sum(o * do) and its gradients with respect to all five inputs (the
value keeps the forward's output kernels, which XLA drops from the gradients alone).
On a GPU where `import fla` works, fla's
Triton `chunk_kda` (PyTorch) runs on the same shapes in bf16, for reference (figures:
experiments/results/bench_kda.md). --gated calls the op as the KDA layer does, with the
decay gate's pre-activation and parameters in place of g (kimijax.ops.kda.kda's a_log, dt_bias).
--kernels lists the device time of every kernel inside one call of 'pallas' and of fla, from
their profilers: the per-kernel comparison of the two, without the launch gaps of --stages.
--short_conv adds the layer's short conv + activation (kimijax.ops.short_conv) under each of its
impls (--conv_tiles: the Pallas kernels under other settings too, ShortConvSettings; with
--kernels, each kernel's device time in forward+backward). --kda_tiles times impl='pallas' under
other settings of its kernels (KdaSettings; with --stages, its stages too). Each figure is the median (and min) of
--repeats timed calls after --warmup calls, each call waited for; the 'queued' columns are the
mean of --repeats calls issued back to back and waited for once, the time per call when the host
runs ahead of the device, as in training (timing.queued_ms). --timeline=N traces N waited calls
of impl='pallas' and splits each one's wall time into its kernels and the time between and
around them, with the host's events inside it: where a waited call's time outside the kernels
goes. Prints a Markdown table.
"""

from absl import app, flags

from experiments import runs

flags.DEFINE_integer('batch', 8, 'B', lower_bound=1)
flags.DEFINE_integer('seq_len', 4096, 'T', lower_bound=1)
flags.DEFINE_integer('heads', 16, 'H', lower_bound=1)
flags.DEFINE_integer('head_dim', 128, 'K = V', lower_bound=1)
flags.DEFINE_integer('chunk_size', 64, "chunk length of impl='xla'", lower_bound=1)
flags.DEFINE_enum(
  'dtype',
  None,
  ['bfloat16', 'float16', 'float32'],
  'input dtype of q, k, v, beta (g is float32); default bfloat16 on GPU, float32 on CPU',
)
flags.DEFINE_list('impls', ['xla_recurrent', 'xla', 'pallas', 'fla'], "what to time: kimijax.ops.kda.IMPLS and 'fla'")


def _known_impls(names: list[str]) -> bool:
  from kimijax.ops.kda import IMPLS

  return set(names) <= {*IMPLS, 'fla'}


flags.register_validator(
  'impls', _known_impls, "--impls: each a key of kimijax.ops.kda.IMPLS, or 'fla' (its chunk_kda)"
)
flags.DEFINE_integer('repeats', 10, 'timed calls per figure', lower_bound=1)
flags.DEFINE_integer('warmup', 2, 'untimed calls first (the first compiles)', lower_bound=0)
flags.DEFINE_bool(
  'stages',
  False,
  "also time each stage of impl='pallas' on its own (forward kernels, "
  "the backward's recomputation, reverse state pass and input gradients)",
)
flags.DEFINE_list(
  'kda_tiles',
  [''],
  'settings of the KDA kernels (kernels_pallas.kda.settings.KdaSettings) '
  "to time impl='pallas' under "
  "(and its stages, with --stages), one per entry, each 'key=int/key=int' (e.g. "
  "warps_diag=2/heads_diag=8); '' is the defaults",
)
flags.DEFINE_float('gate_log_max', 0.5, 'g = -exp(U(-7, gate_log_max))')
flags.DEFINE_bool(
  'gated',
  False,
  "call the op as the KDA layer does: with the decay gate's pre-activation "
  'f ~ N(0, 1) in the input dtype, a_log and dt_bias at their init distributions, in '
  "place of g (formed inside the Pallas kernels; --kda_tiles=,fused_gate=0 for XLA's "
  'gate); forward+backward also differentiates a_log and dt_bias. Not for fla',
)
flags.DEFINE_bool(
  'kernels',
  False,
  'on a GPU: also the device time of each kernel inside one call of '
  "'pallas' (jax.profiler) and of fla (torch.profiler), forward and forward+backward, "
  'averaged over --repeats calls: where the two implementations differ',
)
flags.DEFINE_integer(
  'timeline',
  0,
  "trace this many synchronised calls of impl='pallas' (forward, then "
  "forward+backward) and split each one's wall time into its kernels, the time before the "
  'first, the gaps between them and the time after the last, with the idle gaps and host '
  'events of 20 us or more (experiments/tools/profile_summary.call_timelines)',
)
flags.DEFINE_bool(
  'short_conv',
  False,
  "also time the KDA layer's short conv + SiLU + L2 norm "
  '(kimijax.ops.short_conv, one of q, k, v at the same shape) under each of its impls',
)
flags.DEFINE_list(
  'conv_tiles',
  [''],
  'with --short_conv: settings of the short-conv kernels (kernels_pallas.'
  "short_conv.settings.ShortConvSettings) to time impl='pallas' under, '' for the defaults "
  '(e.g. --conv_tiles=,dz_tiles=1/dz_rows=32)',
)
FLAGS = flags.FLAGS


def _time(fn, repeats, warmup, sync):
  from experiments.bench import timing

  return timing.call_ms(fn, repeats=repeats, warmup=warmup, sync=sync)


def _cells(fns, sync):
  """The table's cells for the calls fns (forward, forward+backward): each one's median (min) ms
  over single waited calls, then each one's mean ms queued back to back (timing.queued_ms)."""
  from experiments.bench import timing

  single = ['%.2f (%.2f)' % _time(f, FLAGS.repeats, FLAGS.warmup, sync) for f in fns]
  return single + ['%.2f' % timing.queued_ms(f, repeats=FLAGS.repeats, warmup=1, sync=sync) for f in fns]


def _log_decay(key, shape):
  """g = -exp(U(-7, --gate_log_max)), float32."""
  import jax
  import jax.numpy as jnp

  return -jnp.exp(jax.random.uniform(key, shape, jnp.float32, -7.0, FLAGS.gate_log_max))


HEADER = ('implementation', 'forward ms', 'forward+backward ms', 'forward, queued ms', 'forward+backward, queued ms')


def _print_row(row):
  """One Markdown table row, its missing cells left empty."""
  print('| ' + ' | '.join(list(row) + [''] * (len(HEADER) - len(row))) + ' |', flush=True)


def _jax_rows(shape, dtype_name, impls, label='', settings=None):
  """The op's forward and forward+backward under each of `impls`, one printed row each
  (`label` is appended to the row's name); settings: the Pallas kernels' (None: the defaults)."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import kda as kda_lib

  b, t, h, d = shape
  dtype = jnp.dtype(dtype_name)
  keys = jax.random.split(jax.random.key(0), 6)
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(jax.random.normal(keys[0], (b, t, h, d))).astype(dtype)
  k = unit(jax.random.normal(keys[1], (b, t, h, d))).astype(dtype)
  v = jax.random.normal(keys[2], (b, t, h, d), dtype)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h))).astype(dtype)
  do = jax.random.normal(keys[5], (b, t, h, d), dtype)
  if FLAGS.gated:  # a_log, dt_bias from the KDA layer's initialisers; f a unit normal
    from kimijax.layers.kda import a_log_init, dt_bias_init

    gate_keys = jax.random.split(keys[3], 3)
    g = jax.random.normal(gate_keys[0], shape, dtype)
    gate = (a_log_init(gate_keys[1], (h,), jnp.float32), dt_bias_init(gate_keys[2], (h, d), jnp.float32))
  else:
    g, gate = _log_decay(keys[3], shape), ()
  args = (q, k, v, g, beta) + gate
  sync = jax.block_until_ready
  rows = []
  for impl in impls:
    if impl not in kda_lib.IMPLS:
      continue

    def fn(q, k, v, g, beta, *gate, impl=impl):
      kw = dict(zip(('a_log', 'dt_bias'), gate))
      return kda_lib.kda(q, k, v, g, beta, impl=impl, chunk_size=FLAGS.chunk_size, settings=settings, **kw)[0]

    fwd = jax.jit(fn)
    loss = lambda do, *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32) * do.astype(jnp.float32))
    fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1, len(args) + 1))))
    row = [f'kimijax {impl}{label}']
    calls = ((fwd, args), (fwd_bwd, (do,) + args))
    try:
      row += _cells([lambda f=f, a=f_args: f(*a) for f, f_args in calls], sync)
    except NotImplementedError:
      row.append('not built yet')
    except Exception as e:  # noqa: BLE001 - e.g. out of memory for the recurrence's backward
      row.append(f'failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}')
    rows.append(row)
    _print_row(row)
    if FLAGS.kernels and impl == 'pallas' and jax.default_backend() == 'gpu':
      for direction, (f, f_args) in zip(('forward', 'forward+backward'), calls):
        _print_kernels(f'kimijax {impl}{label} {direction}', _jax_kernel_ms(lambda f=f, a=f_args: f(*a)))
    if FLAGS.timeline and impl == 'pallas':
      for direction, (f, f_args) in zip(('forward', 'forward+backward'), calls):
        _print_timeline(f'kimijax {impl}{label} {direction}', lambda f=f, a=f_args: f(*a))
  return rows


def _profiled(call, run):
  """The perfetto trace (profile_summary.read_trace) of run() under jax.profiler, after one
  untimed call() outside it (the first call compiles)."""
  import tempfile

  import jax

  from experiments.tools import profile_summary

  jax.block_until_ready(call())
  with tempfile.TemporaryDirectory() as directory:
    with jax.profiler.trace(directory, create_perfetto_trace=True):
      run()
    return profile_summary.read_trace(profile_summary.newest_trace(directory))


def _jax_kernel_ms(call):
  """[(kernel name, device ms per call)] of call() under jax.profiler, --repeats calls after one
  untimed one, longest first (experiments/tools/profile_summary.py reads the trace)."""
  import jax

  from experiments.tools import profile_summary

  def run():
    for _ in range(FLAGS.repeats):
      out = call()
    jax.block_until_ready(out)

  events = profile_summary.device_events(_profiled(call, run))
  return profile_summary.summarise(events, FLAGS.repeats)[1]


def _print_timeline(what, call):
  """--timeline synchronised calls of call() under jax.profiler, one TraceAnnotation each: a row
  per call splitting its wall time (profile_summary.call_timelines), then one per idle gap between
  its kernels and per host event inside it, of 20 us or more (ms, from the call's start)."""
  import jax

  from experiments.tools import profile_summary

  def run():
    for i in range(FLAGS.timeline):
      with jax.profiler.TraceAnnotation(f'timeline call {i + 1}'):
        jax.block_until_ready(call())

  trace = _profiled(call, run)
  ms = lambda us: '%.3f' % (us / 1e3)
  for c in profile_summary.call_timelines(trace, 'timeline call ', min_us=20.0):
    at = f'{what}, {c["name"][len("timeline ") :]}'
    _print_row(
      [
        f'{at}: wall',
        ms(c['span_us']),
        f'kernels {ms(c["kernel_us"])}, before the first '
        f'{ms(c["lead_us"])}, between {ms(c["gaps_us"])}, after the last {ms(c["tail_us"])}',
      ]
    )
    for start, _, gap, name in c['kernels']:
      if gap >= 20.0:
        _print_row([f'{at}: idle before {name[:60]} (at +{ms(start)})', ms(gap)])
    for start, dur, name in c['host']:
      _print_row([f'{at}: host {name[:60]} (at +{ms(start)})', ms(dur)])


def _torch_kernel_ms(call):
  """The same for a PyTorch call, from torch.profiler's CUDA kernel events."""
  import torch
  from torch.profiler import ProfilerActivity, profile

  call()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(FLAGS.repeats):
      call()
    torch.cuda.synchronize()
  device_us = lambda e: getattr(e, 'self_device_time_total', None) or getattr(e, 'self_cuda_time_total', 0.0)
  totals = [(e.key, device_us(e) / 1e3 / FLAGS.repeats) for e in prof.key_averages()]
  return sorted([kv for kv in totals if kv[1] > 0], key=lambda kv: -kv[1])


def _print_kernels(what, kernels):
  """Rows 'what: kernel | ms' (the sum first), in the timing table's columns."""
  _print_row([f'{what}: all kernels', '%.3f' % sum(ms for _, ms in kernels)])
  for name, ms in kernels:
    _print_row([f'{what}: {name[:80]}', '%.3f' % ms])


def _stage_rows(shape, dtype_name, settings):
  """Each Pallas kernel of impl='pallas' on its own (kernels_pallas/kda/op.py) under `settings`
  (a KdaSettings), jitted separately; what the forward+backward time leaves over is XLA's share
  (padding, casts, the sums of the partial gradients)."""
  import jax
  import jax.numpy as jnp

  from kernels_pallas.kda import op

  b, t, h, d = shape
  dtype = jnp.dtype(dtype_name)
  keys = jax.random.split(jax.random.key(1), 6)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype) * d**-0.5
  k = jax.random.normal(keys[1], (b, t, h, d), dtype) * d**-0.5
  v = jax.random.normal(keys[2], (b, t, h, d), dtype)
  g = _log_decay(keys[3], shape)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, h)))
  do = jax.random.normal(keys[5], (b, t, h, d), dtype)
  s0 = jnp.zeros((b, h, d, d), jnp.float32)
  c, scale = op.chunk_len(t), d**-0.5
  interp = jax.default_backend() != 'gpu'
  kw = dict(c=c, settings=settings, interpret=interp)
  gc = op.chunk_cumsum(g, c, settings=settings, interpret=interp)
  scores = jax.jit(lambda *a: op.scores_fwd(*a, scale=scale, **kw))
  aqk, n = scores(q, k, gc, beta)
  inverse = jax.jit(lambda n: op.wy_inverse(n, dtype=dtype, **kw))
  t_inv = inverse(n)
  apply = jax.jit(lambda *a: op.wy_apply(*a, scale=scale, **kw))
  qg, kg, w, u = apply(t_inv, q, k, v, gc, beta)
  state = {
    with_h: jax.jit(lambda *a, with_h=with_h: op.state_fwd(*a, out_dtype=dtype, with_h=with_h, **kw))
    for with_h in (False, True)
  }
  bwd = jax.jit(lambda *a: op.state_bwd(*a, **kw))
  f32 = lambda x: x.astype(jnp.float32)
  sbwd = jax.jit(lambda *a: op.scores_bwd(*a, scale=scale, **kw))
  cumsum = {
    rev: jax.jit(lambda x, rev=rev: op.chunk_cumsum(x, c, reverse=rev, settings=settings, interpret=interp))
    for rev in (False, True)
  }
  f_pre = g.astype(dtype)  # the gated kernels read the gate's pre-activation in the input dtype
  rows_hk = jnp.full((h, d), 4.0), jnp.full((h, d), -4.0)  # exp(A_log), dt_bias
  gate_kw = dict(lower_bound=0.0, t_valid=None, settings=settings, interpret=interp)
  gated = jax.jit(lambda f: op.gated_cumsum(f, *rows_hk, c, **gate_kw))
  ends = jnp.zeros((b, t // c, h, d), jnp.float32)
  gated_rev = jax.jit(lambda x, f: op.gated_reverse_cumsum(x, ends, f, *rows_hk, c, **gate_kw))
  v_new, _, hs = state[True](qg, kg, w, u, aqk, gc, s0)
  _, dh, dv_new = bwd(qg, kg, w, aqk, gc, do, s0)
  cot = jax.jit(lambda *a: op.chunk_cotangents(*a, **kw))
  dw = cot(hs, dh, do, dv_new, v_new)[2]
  wy_back = jax.jit(lambda *a: op.wy_backward(*a, **kw))
  sync = jax.block_until_ready
  diag = jax.jit(lambda *a: op.diag_fwd(*a, scale=scale, settings=settings, interpret=interp))
  stages = [
    ('chunk_cumsum', lambda: cumsum[False](g)),
    ('chunk_cumsum reverse (backward)', lambda: cumsum[True](g)),
    ('gated cumsum (the gate fused: --gated)', lambda: gated(f_pre)),
    ('gated reverse cumsum (backward)', lambda: gated_rev(g, f_pre)),
    ('diag_fwd (part of scores_fwd when a sub-chunk is steep)', lambda: diag(q, k, gc, beta)),
    ('scores_fwd', lambda: scores(q, k, gc, beta)),
    ('wy_inverse', lambda: inverse(n)),
    ('wy_apply (forward and backward)', lambda: apply(t_inv, q, k, v, gc, beta)),
    ('state_fwd', lambda: state[False](qg, kg, w, u, aqk, gc, s0)),
    ('state_fwd writing h, v_new (the backward)', lambda: state[True](qg, kg, w, u, aqk, gc, s0)),
    ('state_bwd', lambda: bwd(qg, kg, w, aqk, gc, do, s0)),
    ('chunk_cotangents', lambda: cot(hs, dh, do, dv_new, v_new)),
    ('wy_backward', lambda: wy_back(t_inv, dw, dv_new, k, v, gc, beta)),
    ('scores_bwd', lambda: sbwd(q, k, gc, beta, qg, kg, f32(aqk), n, f32(k), gc, beta)),
  ]
  return [
    [f'pallas stage: {name}', '%.2f (%.2f)' % _time(fn, FLAGS.repeats, FLAGS.warmup, sync)] for name, fn in stages
  ]


def _short_conv_rows(shape, dtype_name):
  """kimijax.ops.short_conv with 'silu_l2' (q's and k's activation) on x [B, T, H, K]: forward, and
  sum(y * dy) and its gradients with respect to x and the taps."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import short_conv as sc

  keys = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(keys[0], shape, jnp.dtype(dtype_name))
  w = jax.random.uniform(keys[1], (4,) + shape[2:], jnp.float32, -0.5, 0.5)
  dy = jax.random.normal(keys[2], shape, jnp.dtype(dtype_name))
  from kernels_pallas.short_conv.settings import ShortConvSettings

  settings = [(text, ShortConvSettings.from_string(text)) for text in FLAGS.conv_tiles]
  rows = []
  for impl, (text, conv_settings) in [('xla', ('', None))] + [('pallas', st) for st in settings]:
    fn = lambda x, w, impl=impl, st=conv_settings: sc.short_conv(x, w, 'silu_l2', impl=impl, settings=st)[0]
    loss = lambda x, w, dy, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32) * dy.astype(jnp.float32))
    calls = ((jax.jit(fn), (x, w)), (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (x, w, dy)))
    row = [f'short_conv {impl} (silu_l2)' + (f' [{text}]' if text else '')] + _cells(
      [lambda f=f, a=a: f(*a) for f, a in calls], jax.block_until_ready
    )
    rows.append(row)
    _print_row(row)
    if FLAGS.kernels and jax.default_backend() == 'gpu':
      f, a = calls[1]
      _print_kernels(row[0] + ' forward+backward', _jax_kernel_ms(lambda f=f, a=a: f(*a)))
  return rows


def _fla_rows(shape):
  """fla's Triton chunk_kda on the same shape (bf16), when PyTorch + fla + a CUDA device exist:
  its printed row (and with --kernels its kernels')."""
  try:
    import torch
    from fla.ops.kda import chunk_kda
  except ImportError as e:
    return _print_row(['fla chunk_kda', f'skipped ({e})'])
  if not torch.cuda.is_available():
    return _print_row(['fla chunk_kda', 'skipped (no CUDA device for PyTorch)'])
  b, t, h, d = shape
  gen = torch.Generator(device='cuda').manual_seed(0)
  randn = lambda *s: torch.randn(*s, device='cuda', generator=gen)
  unit = lambda x: x / x.norm(dim=-1, keepdim=True)
  q = unit(randn(b, t, h, d)).bfloat16().requires_grad_()
  k = unit(randn(b, t, h, d)).bfloat16().requires_grad_()
  v = randn(b, t, h, d).bfloat16().requires_grad_()
  g = (
    -torch.exp(torch.rand(b, t, h, d, device='cuda', generator=gen) * (FLAGS.gate_log_max + 7.0) - 7.0)
  ).requires_grad_()
  beta = torch.sigmoid(randn(b, t, h)).bfloat16().requires_grad_()
  do = randn(b, t, h, d).bfloat16()
  sync = lambda _: torch.cuda.synchronize()

  def fwd():
    with torch.no_grad():
      return chunk_kda(q, k, v, g, beta)[0]

  def fwd_bwd():
    o, _ = chunk_kda(q, k, v, g, beta)
    return torch.autograd.grad(o, (q, k, v, g, beta), do)

  _print_row(['fla chunk_kda (Triton, bf16)'] + _cells((fwd, fwd_bwd), sync))
  if FLAGS.kernels:
    for direction, f in (('forward', fwd), ('forward+backward', fwd_bwd)):
      _print_kernels(f'fla {direction}', _torch_kernel_ms(f))


def main(argv):
  del argv
  import jax

  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.head_dim)
  backend = jax.default_backend()
  dtype = FLAGS.dtype or ('float32' if backend == 'cpu' else 'bfloat16')
  runs.print_header(['torch', 'fla'] if 'fla' in FLAGS.impls else [])  # fla's chunk_kda runs on PyTorch
  print(
    f'shape B={shape[0]} T={shape[1]} H={shape[2]} K=V={shape[3]}; inputs {dtype} (g float32); '
    f'chunk_size {FLAGS.chunk_size}; median (min) of {FLAGS.repeats} calls in ms, each waited for; '
    f'queued: the mean of {FLAGS.repeats} calls issued back to back and waited for once\n'
  )
  _print_row(HEADER)
  _print_row(['---'] * len(HEADER))
  from kernels_pallas.kda.settings import KdaSettings

  # every --kda_tiles and --conv_tiles entry checked before anything runs
  settings = [KdaSettings.from_string(text) for text in FLAGS.kda_tiles]
  if FLAGS.short_conv:
    from kernels_pallas.short_conv.settings import ShortConvSettings

    for text in FLAGS.conv_tiles:
      ShortConvSettings.from_string(text)
  _jax_rows(shape, dtype, FLAGS.impls)  # each row is printed as soon as it is timed
  if FLAGS.short_conv:
    _short_conv_rows(shape, dtype)
  for text, kda_settings in zip(FLAGS.kda_tiles, settings):
    if text and 'pallas' in FLAGS.impls:  # the whole op under this setting (the default's row is above)
      _jax_rows(shape, dtype, ['pallas'], f' [{text}]', settings=kda_settings)
    if FLAGS.stages:
      for row in _stage_rows(shape, dtype, kda_settings):
        _print_row([row[0] + (f' [{text}]' if text else '')] + row[1:])
  if 'fla' in FLAGS.impls and backend == 'gpu' and not FLAGS.gated:
    _fla_rows(shape)


if __name__ == '__main__':
  app.run(main)
