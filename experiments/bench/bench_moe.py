"""MoE layer timings (issue 37): kimijax.layers.moe.MoE forward+backward against a dense SwiGLU
with the same active FLOPs, side by side in one process, and the dispatch's parts on their own.

    python -m experiments.bench.bench_moe                                        # one H200: the shapes below
    python -m experiments.bench.bench_moe --configs=64x8x512 --impls=tokamax,xla
    python -m experiments.bench.bench_moe --configs=64x8x256 --impls=xla_blocked,pallas --noparts --matmuls
    python -m experiments.bench.bench_moe --configs=64x8x512 --impls=mosaic --noparts --matmuls --kernels
    python -m experiments.bench.bench_moe --configs=4x2x16 --tokens=256 --d_model=32 --impls=xla   # CPU smoke

Configs 'ExKxF' (routed experts, top-k, expert hidden): by default 64 and 256 experts, top-8, expert
hidden 512 and 1024, over --tokens=65536 tokens (16 sequences of 4096) of --d_model=1024, in bf16
on a GPU (float32 elsewhere), sigmoid routing renormalised, --shared shared experts (0 by default:
the routed part alone). The dense baseline is kimijax.layers.mlp.SwiGLU of hidden F * (K + shared):
the same expert matmul FLOPs per token.

Table 1, per config and grouped-matmul impl: the MoE layer (router, routing, dispatch, experts,
combine, the router statistics the train step reads) and the dense SwiGLU, forward and
forward+backward (the loss sum(y * dy) and its gradients with respect to the parameters and x,
as a training step computes both: the gradients alone of that linear loss do not need y, and XLA
would drop the forward's last matmul and the combine from both sides), each the median
(min) of --repeats calls in ms after --warmup, with TFLOP/s over the active FLOPs: forward
2 T D (3 F (K + shared) + E) (the expert matmuls and the router), forward+backward 3x that; and
the ratio MoE / dense of the forward+backward times (the issue's bar: <= 1.5, goal <= 1.2).
Table 2, the parts of the routed path (kimijax.ops.moe) at the same shapes: 'router logits'
(router_logits, as the layer computes them), 'routing' (route: scores, top-k and weights from the
logits), 'sort' (sort_by_expert), 'expert load' (the counts the train step's metrics and bias update
read), 'permute' (the gather of the T K rows), 'grouped swiglu' (expert_swiglu: the two grouped
matmuls), 'combine' (inverse permutation and weighted sum, float32), forward and forward+backward (a
loss and its gradients, as in table 1) where there is a gradient. 'xla_blocked' (and 'pallas', the
same layout with Triton kernels: kernels_pallas/moe/; each at its default settings or under each of
its --moe_tiles, one row each) runs permute, grouped swiglu and combine as one padded-layout
function in the layer (the rows never in sorted order; kimijax/ops/moe.py): its row 'padded swiglu'
times that, from the tokens to the weighted sum, so that router logits + routing + sort + padded
swiglu are its routed path; its 'grouped swiglu' row times it as a plain grouped matmul
(expert_swiglu). Table 3 (--matmuls), one grouped matmul of the expert SwiGLU at a time (the
ragged_dot contract, gathers included: rows [T K, A] in the routing's groups times [E, A, B]): its
forward, input gradient and weight gradient, each jitted on its own, against the dense matmul of the
same rows ([T K, A] x [A, B] and its two gradients) at the two shapes of the experts (A x B = D x
2F, then F x D). Table 4 (--kernels), the same products by the tile kernels alone of an impl that
has them ('pallas', 'mosaic': kimijax.ops.moe.tile_kernels) on rows already gathered into the padded
layout's slots (tiles of block_m rows per expert): what table 3 costs beyond the kernels is the
gathers into the slots and back. An impl that cannot run here, or a cell out of memory, is a cell
saying so, not a crash. Prints Markdown.
Results go to experiments/results/moe.md.
"""

import math
import os

CONFIGS = ('64x8x512', '64x8x1024', '256x8x512', '256x8x1024')
IMPLS = ('tokamax',)


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  from absl import flags

  flags.DEFINE_list('configs', list(CONFIGS), "'ExKxF': routed experts, top-k, expert hidden")
  flags.DEFINE_integer('tokens', 65536, 'tokens per call (16 sequences of tokens / 16)', lower_bound=16)
  flags.DEFINE_integer('d_model', 1024, 'D', lower_bound=1)
  flags.DEFINE_integer('shared', 0, 'shared experts (each of width F)', lower_bound=0)
  flags.DEFINE_list(
    'impls',
    list(IMPLS),
    "grouped matmul impls (kimijax.ops.moe.IMPLS); 'xla' is "
    'jax.lax.ragged_dot, which may lower to a dense dot over all experts on a GPU',
  )
  flags.DEFINE_list(
    'moe_tiles',
    [''],
    "settings to time an impl that takes them under, one row each: 'IMPL:TEXT' for that impl ('pallas': a "
    "MoeSettings, e.g. 'pallas:block_m=64/warps=4'; 'xla_blocked': a BlockedSettings, e.g. "
    "'xla_blocked:blocks_per_group=8'; 'pallas:' its defaults), TEXT for every such impl; an impl named in "
    'none: its defaults',
  )
  flags.DEFINE_string(
    'profile_dir',
    None,
    'also trace 3 forward+backward calls of each MoE cell of table 1 into DIR/<config>_<impl> '
    '(read with experiments/tools/profile_summary.py --steps=3; with XLA_FLAGS=--xla_dump_to=HLO and one config, '
    '--hlo_dump=HLO --module=loss names the ops)',
  )
  flags.DEFINE_enum(
    'dtype', None, ['bfloat16', 'float16', 'float32'], 'compute dtype; default bfloat16 on a GPU, float32 elsewhere'
  )
  flags.DEFINE_bool('parts', True, 'also time the dispatch parts (table 2)')
  flags.DEFINE_bool(
    'matmuls', False, "also time one grouped matmul and each of its gradients against cuBLAS's (table 3)"
  )
  flags.DEFINE_bool('kernels', False, 'also time the tile kernels alone, without the gathers (table 4)')
  flags.DEFINE_integer('repeats', 10, 'timed calls per cell', lower_bound=1)
  flags.DEFINE_integer('warmup', 2, 'untimed calls first (the first compiles)', lower_bound=0)
  flags.register_validator('configs', _valid_configs, "--configs: each entry 'ExKxF' (experts x top-k x hidden)")


def _valid_configs(names: list[str]) -> bool:
  """The --configs validator: every entry parses (parse_config raises, naming the entry)."""
  from absl import flags

  for name in names:
    try:
      parse_config(name)
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
  return True


def parse_config(name: str) -> tuple[int, int, int]:
  parts = name.split('x')
  if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--configs entry {name!r} is not 'ExKxF' (routed experts x top-k x expert hidden)")
  e, k, f = (int(p) for p in parts)
  if k > e:
    raise ValueError(f'--configs entry {name!r}: top-k {k} exceeds the {e} experts')
  return e, k, f


def forward_tflop(tokens: int, d_model: int, hidden: int, experts: int = 0) -> float:
  """Forward TFLOP of a SwiGLU of (active) hidden width `hidden` over `tokens` tokens of d_model,
  plus a router to `experts` experts: 2 flops per multiply-add of the three matmuls and the
  router."""
  return 2.0 * tokens * d_model * (3 * hidden + experts) / 1e12


def _error_cell(e: Exception) -> str:
  text = str(e)
  if 'RESOURCE_EXHAUSTED' in text or 'out of memory' in text.lower():
    return 'out of memory'
  return f'failed: {type(e).__name__}: {text.splitlines()[0][:80] if text else ""}'


def _na_cell(problem: str) -> str:
  """'n/a: needs an NVIDIA GPU, ...' from kimijax.ops.moe.unsupported's message."""
  return 'n/a: needs ' + problem.split(';')[0].split(' needs ', 1)[-1]


def _timed(fn, args, tflop, repeats, warmup) -> tuple[str, float | None]:
  """(cell, median ms or None)."""
  from experiments.bench import timing

  try:
    median, best = timing.call_ms(lambda: fn(*args), repeats=repeats, warmup=warmup)
  except Exception as e:  # noqa: BLE001 - out of memory, a shape a kernel refuses
    return _error_cell(e), None
  cell = f'{median:.2f} ({best:.2f})'
  return (cell + f', {tflop / median * 1e3:.3g} TFLOP/s' if tflop else cell), median


def _trace(fn, args, directory, calls=3):
  """A profiler trace (perfetto JSON too) of `calls` waited calls of fn(*args) in directory."""
  import jax

  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(calls):
      jax.block_until_ready(fn(*args))


def _fwd_and_grad(apply, params, x):
  """Jitted forward and forward+backward (the loss sum(y * dy) in float32 and its gradients with
  respect to the params and x: the value keeps y, which the gradients alone do not need) of
  apply(params, x) -> y."""
  import jax
  import jax.numpy as jnp

  dy = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)

  def loss(p, x, dy):  # named: its jitted gradient is the dump's module jit_loss (profile_summary --module=loss)
    return jnp.sum(apply(p, x).astype(jnp.float32) * dy)

  return jax.jit(apply), _bound(jax.value_and_grad(loss, argnums=(0, 1)), dy=dy)


def _bound(fn, **arrays):
  """jit(fn) with `arrays` passed as arguments on every call: a jitted closure over them would
  embed them in the program as constants (gigabytes here, slow to compile)."""
  import functools

  import jax

  return functools.partial(jax.jit(fn), **arrays)


def impl_variants(impls, moe_tiles=('',)):
  """[(row label, impl, settings)]: an impl that takes settings (kimijax.ops.moe.IMPLS[impl].parse_settings)
  once per entry of moe_tiles that applies to it ('IMPL:TEXT' to that impl, a plain TEXT to every
  such impl; none: once at its defaults), labelled with the text where it is not the defaults;
  every other impl once."""
  from kimijax.ops import moe as moe_ops

  variants = []
  for impl in impls:
    parse = moe_ops.IMPLS[impl].parse_settings if impl in moe_ops.IMPLS else None
    if parse is None:
      variants.append((impl, impl, None))
      continue
    entries = [entry.partition(':') for entry in moe_tiles]  # (impl, ':', text) or (text, '', '')
    texts = [text if sep else name for name, sep, text in entries if not sep or name == impl]
    for text in texts or ('',):
      variants.append((f'{impl} ({text})' if text else impl, impl, parse(text)))
  return variants


def _inputs(tokens, d_model, dtype):
  import jax

  seqs = 16 if tokens % 16 == 0 else 1
  return jax.random.normal(jax.random.key(0), (seqs, tokens // seqs, d_model), dtype)


def layer_rows(
  config_names,
  impls,
  tokens=65536,
  d_model=1024,
  shared=0,
  dtype_name=None,
  repeats=10,
  warmup=2,
  moe_tiles=('',),
  profile_dir=None,
):
  """Yields table 1's rows: [config, impl, MoE forward, MoE forward+backward, dense forward,
  dense forward+backward, ratio]; an impl that takes settings once per its moe_tiles entry
  (impl_variants). profile_dir: also trace 3 forward+backward calls of each MoE cell there (a
  folder per config and impl)."""
  import jax
  import jax.numpy as jnp

  from kimijax.layers.mlp import SwiGLU
  from kimijax.layers.moe import MOE_STATE, MOE_STATS, MoE, moe_aux_loss
  from kimijax.ops import moe as moe_ops

  dtype = jnp.dtype(dtype_name or ('bfloat16' if jax.default_backend() == 'gpu' else 'float32'))
  x = _inputs(tokens, d_model, dtype)
  for name in config_names:
    e, k, f = parse_config(name)
    hidden = f * (k + shared)
    dense = SwiGLU(hidden=hidden, init_std=0.02, dtype=dtype)
    dense_params = jax.jit(dense.init)(jax.random.key(2), x)['params']
    fwd, grad = _fwd_and_grad(lambda p, x: dense.apply({'params': p}, x), dense_params, x)
    dense_tflop = forward_tflop(tokens, d_model, hidden)
    dense_fwd, _ = _timed(fwd, (dense_params, x), dense_tflop, repeats, warmup)
    dense_grad, dense_ms = _timed(grad, (dense_params, x), 3 * dense_tflop, repeats, warmup)
    del dense_params
    moe_tflop = forward_tflop(tokens, d_model, hidden, e)
    for impl_label, impl, settings in impl_variants(impls, moe_tiles):
      label = f'{name} (E={e}, K={k}, F={f}, shared={shared})'
      problem = moe_ops.unsupported(impl, dtype, d_model, f)
      if problem:
        cell = _na_cell(problem)
        yield [label, impl_label, cell, cell, dense_fwd, dense_grad, '-']
        continue
      layer = MoE(
        num_experts=e,
        top_k=k,
        expert_hidden=f,
        num_shared=shared,
        scaling_factor=2.446,
        dtype=dtype,
        impl=impl,
        settings=settings,
      )
      variables = jax.jit(layer.init)(jax.random.key(3), x)
      state = variables[MOE_STATE]

      def apply(p, x, layer=layer, state=state):
        y, stats = layer.apply({'params': p, MOE_STATE: state}, x, mutable=[MOE_STATS])
        return y + moe_aux_loss(stats[MOE_STATS]).astype(y.dtype)  # what the train step computes

      fwd, grad = _fwd_and_grad(apply, variables['params'], x)
      moe_fwd, _ = _timed(fwd, (variables['params'], x), moe_tflop, repeats, warmup)
      moe_grad, moe_ms = _timed(grad, (variables['params'], x), 3 * moe_tflop, repeats, warmup)
      if profile_dir and moe_ms:
        _trace(grad, (variables['params'], x), os.path.join(profile_dir, f'{name}_{impl_label}'.replace(' ', '')))
      ratio = f'{moe_ms / dense_ms:.2f}' if moe_ms and dense_ms else '-'
      del variables
      yield [label, impl_label, moe_fwd, moe_grad, dense_fwd, dense_grad, ratio]


def _routed_groups(x_td, e: int, k: int):
  """Random router weights' routing of x_td as the layer computes it (`router_logits`, then sigmoid
  routing renormalised with Moonlight's scaling) and its dispatch: (routing, dispatch, parts), parts
  the jitted functions {'router logits': (x, W_r), 'routing': (logits,), 'sort': (experts,),
  'expert load': (experts,)} and their arguments, for table 2."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import moe as moe_ops

  w_router = 0.02 * jax.random.normal(jax.random.key(5), (x_td.shape[1], e), jnp.float32)
  router = jax.jit(moe_ops.router_logits)
  route = jax.jit(lambda logits: moe_ops.route(logits, None, top_k=k, scaling_factor=2.446))
  logits = router(x_td, w_router)
  routing = route(logits)
  sort = jax.jit(lambda ex: moe_ops.sort_by_expert(ex, e))
  parts = {
    'router logits': (router, (x_td, w_router)),
    'routing': (route, (logits,)),
    'sort': (sort, (routing.experts_tk,)),
    'expert load': (jax.jit(lambda ex: moe_ops.expert_load(ex, e)), (routing.experts_tk,)),
  }
  return routing, sort(routing.experts_tk), parts


def _timed_sum(calls, tflop, repeats, warmup) -> tuple[list[str], float | None]:
  """([cell of each (fn, args) in calls], the sum of their median ms, or None where one did not run)."""
  timed = [_timed(fn, args, tflop, repeats, warmup) for fn, args in calls]
  medians = [ms for _, ms in timed]
  return [cell for cell, _ in timed], (sum(medians) if None not in medians else None)


def matmul_rows(
  config_names, impls, tokens=65536, d_model=1024, dtype_name=None, repeats=10, warmup=2, moe_tiles=('',), alone=False
):
  """Yields table 3's rows (alone: table 4's): [config, A x B, impl, forward, input gradient, weight
  gradient, sum / dense sum], the dense row first; TFLOP/s over the 2 M A B FLOPs of each (the rows',
  not the padding's)."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import moe as moe_ops

  dtype = jnp.dtype(dtype_name or ('bfloat16' if jax.default_backend() == 'gpu' else 'float32'))
  keys = jax.random.split(jax.random.key(6), 4)
  x_td = jax.random.normal(keys[0], (tokens, d_model), dtype)
  for name in config_names:
    e, k, f = parse_config(name)
    sizes = _routed_groups(x_td, e, k)[1].group_sizes_e
    m = tokens * k
    for a, b in ((d_model, 2 * f), (f, d_model)):
      x_ma = jax.random.normal(keys[1], (m, a), dtype)
      dy_mb = jax.random.normal(keys[2], (m, b), dtype)
      w_eab = (jax.random.normal(keys[3], (e, a, b), jnp.float32) / math.sqrt(a)).astype(dtype)
      tflop = 2 * m * a * b / 1e12
      dense = (
        jax.jit(lambda x, w: x @ w[0]),
        jax.jit(lambda dy, w: dy @ w[0].T),
        jax.jit(lambda x, dy: jnp.einsum('ma,mb->ab', x, dy, preferred_element_type=jnp.float32).astype(dtype)),
      )
      cells, dense_ms = _timed_sum(
        [(dense[0], (x_ma, w_eab)), (dense[1], (dy_mb, w_eab)), (dense[2], (x_ma, dy_mb))], tflop, repeats, warmup
      )
      yield [name, f'{a} x {b}', 'dense', *cells, '1']
      for impl_label, impl, settings in impl_variants(impls, moe_tiles):
        problem = moe_ops.unsupported(impl, dtype, d_model, f)
        calls = (
          None if problem else (_kernel_calls if alone else _matmul_calls)(impl, settings, x_ma, w_eab, dy_mb, sizes)
        )
        if calls is None:
          cell = _na_cell(problem) if problem else 'n/a: no tile kernels'
          yield [name, f'{a} x {b}', impl_label, *[cell] * 3, '-']
          continue
        cells, total = _timed_sum(calls, tflop, repeats, warmup)
        ratio = f'{total / dense_ms:.2f}' if total and dense_ms else '-'
        yield [name, f'{a} x {b}', impl_label, *cells, ratio]


def _matmul_calls(impl, settings, x_ma, w_eab, dy_mb, sizes):
  """[(fn, args)] of the impl's grouped matmul (the ragged_dot contract, gathers included): forward,
  input gradient, weight gradient."""
  import jax

  from kimijax.ops import moe as moe_ops

  dot = lambda x, w, sizes: moe_ops.IMPLS[impl].ragged_dot(x, w, sizes, settings)
  forward = _bound(dot, sizes=sizes)
  input_grad = _bound(lambda x, w, dy, sizes: jax.vjp(lambda x: dot(x, w, sizes), x)[1](dy)[0], sizes=sizes)
  weight_grad = _bound(lambda x, w, dy, sizes: jax.vjp(lambda w: dot(x, w, sizes), w)[1](dy)[0], sizes=sizes)
  grads_args = (x_ma, w_eab, dy_mb)
  return [(forward, (x_ma, w_eab)), (input_grad, grads_args), (weight_grad, grads_args)]


def _kernel_calls(impl, settings, x_ma, w_eab, dy_mb, sizes):
  """[(fn, args)] of the impl's tile kernels alone (kimijax.ops.moe.tile_kernels: 'pallas', 'mosaic')
  on the rows already gathered into the padded layout's slots: the tile matmul, the tile matmul on
  the transposed weights, the expert weight gradient; None for an impl without tile kernels."""
  import jax

  from kimijax.ops import moe as moe_ops

  parse = moe_ops.IMPLS[impl].parse_settings
  settings = settings or (parse and parse(''))
  try:
    run = moe_ops.tile_kernels(settings)
  except TypeError:
    return None
  layout = moe_ops._blocked_layout(x_ma.shape[0], sizes, settings.block_m)
  x_pa, dy_pb = (moe_ops._rows(a, layout.src_p) for a in (x_ma, dy_mb))
  e = w_eab.shape[0]
  forward = jax.jit(lambda x, w, t: run('tile_matmul', x, w, t))
  input_grad = jax.jit(lambda dy, w, t: run('tile_matmul', dy, w, t, transpose=True))
  weight_grad = jax.jit(lambda x, dy, t: run('expert_weight_grad', x, dy, t, num_experts=e))
  t = layout.group_b
  return [(forward, (x_pa, w_eab, t)), (input_grad, (dy_pb, w_eab, t)), (weight_grad, (x_pa, dy_pb, t))]


def part_rows(config_names, impls, tokens=65536, d_model=1024, dtype_name=None, repeats=10, warmup=2, moe_tiles=('',)):
  """Yields table 2's rows: [config, part, impl, forward, forward+backward]; an impl that takes settings
  once per its moe_tiles entry (impl_variants)."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import moe as moe_ops

  dtype = jnp.dtype(dtype_name or ('bfloat16' if jax.default_backend() == 'gpu' else 'float32'))
  keys = jax.random.split(jax.random.key(4), 8)
  x_td = jax.random.normal(keys[0], (tokens, d_model), dtype)
  for name in config_names:
    e, k, f = parse_config(name)
    routing, dispatch, parts = _routed_groups(x_td, e, k)
    label = f'{name}'
    router, (_, w_router) = parts['router logits']
    c_te = jax.random.normal(keys[1], (tokens, e), jnp.float32)
    router_grad = _bound(jax.value_and_grad(lambda x, w, c: jnp.sum(router(x, w) * c), argnums=(0, 1)), c=c_te)
    router_tflop = 2 * tokens * d_model * e / 1e12
    yield [
      label,
      'router logits',
      '-',
      _timed(router, (x_td, w_router), router_tflop, repeats, warmup)[0],
      _timed(router_grad, (x_td, w_router), 3 * router_tflop, repeats, warmup)[0],
    ]
    route, (logits,) = parts['routing']
    route_grad = _bound(jax.value_and_grad(lambda u, c: jnp.sum(route(u).weights_tk * c)), c=c_te[:, :k])
    yield [
      label,
      'routing',
      '-',
      _timed(route, (logits,), None, repeats, warmup)[0],
      _timed(route_grad, (logits,), None, repeats, warmup)[0],
    ]
    del c_te, route_grad, router_grad
    for part in ('sort', 'expert load'):
      fn, args = parts[part]
      yield [label, part, '-', _timed(fn, args, None, repeats, warmup)[0], '-']

    permute = _bound(lambda x, dispatch: moe_ops.permute(x, dispatch, k), dispatch=dispatch)
    g_md = jax.random.normal(keys[2], (tokens * k, d_model), jnp.float32)
    permute_grad = _bound(
      jax.value_and_grad(lambda x, dispatch, g: jnp.sum(moe_ops.permute(x, dispatch, k).astype(jnp.float32) * g)),
      dispatch=dispatch,
      g=g_md,
    )
    yield [
      label,
      'permute',
      '-',
      _timed(permute, (x_td,), None, repeats, warmup)[0],
      _timed(permute_grad, (x_td,), None, repeats, warmup)[0],
    ]
    x_md = permute(x_td)
    del g_md, permute_grad

    w = [
      jax.random.normal(kk, shape, dtype) * 0.02
      for kk, shape in zip(keys[3:6], ((e, d_model, f), (e, d_model, f), (e, f, d_model)))
    ]
    for impl_label, impl, settings in impl_variants(impls, moe_tiles):
      problem = moe_ops.unsupported(impl, dtype, d_model, f)
      if problem:
        cell = _na_cell(problem)
        yield [label, 'grouped swiglu', impl_label, cell, cell]
        continue
      swiglu = lambda x, wg, wu, wd, sizes, impl=impl, settings=settings: moe_ops.expert_swiglu(
        x, sizes, wg, wu, wd, impl=impl, settings=settings
      )
      g_out = jax.random.normal(keys[6], (tokens * k, d_model), jnp.float32)
      swiglu_loss = lambda *a, sizes, g: jnp.sum(swiglu(*a, sizes).astype(jnp.float32) * g)
      swiglu_grad = _bound(jax.value_and_grad(swiglu_loss, argnums=(0, 1, 2, 3)), sizes=dispatch.group_sizes_e, g=g_out)
      tflop = forward_tflop(tokens, d_model, f * k)
      yield [
        label,
        'grouped swiglu',
        impl_label,
        _timed(_bound(swiglu, sizes=dispatch.group_sizes_e), (x_md, *w), tflop, repeats, warmup)[0],
        _timed(swiglu_grad, (x_md, *w), 3 * tflop, repeats, warmup)[0],
      ]
      del g_out, swiglu_grad
      if (routed := moe_ops.IMPLS[impl].routed) is not None:
        padded = lambda x, r, *ws, dispatch, routed=routed, settings=settings: routed(x, r, dispatch, *ws, settings)
        g_td = jax.random.normal(keys[7], (tokens, d_model), jnp.float32)
        padded_loss = lambda *a, dispatch, g: jnp.sum(padded(*a, dispatch=dispatch) * g)
        padded_grad = _bound(jax.value_and_grad(padded_loss, argnums=(0, 1, 2, 3, 4)), dispatch=dispatch, g=g_td)
        args = (x_td, routing.weights_tk, *w)
        yield [
          label,
          'padded swiglu',
          impl_label,
          _timed(_bound(padded, dispatch=dispatch), args, tflop, repeats, warmup)[0],
          _timed(padded_grad, args, 3 * tflop, repeats, warmup)[0],
        ]

    weights = routing.weights_tk
    g_td = jax.random.normal(keys[7], (tokens, d_model), jnp.float32)
    combine = lambda y, w, dispatch: moe_ops.combine(y, dispatch, w)
    combine_loss = lambda y, w, dispatch, g: jnp.sum(combine(y, w, dispatch) * g)
    combine_grad = _bound(jax.value_and_grad(combine_loss, argnums=(0, 1)), dispatch=dispatch, g=g_td)
    yield [
      label,
      'combine',
      '-',
      _timed(_bound(combine, dispatch=dispatch), (x_md, weights), None, repeats, warmup)[0],
      _timed(combine_grad, (x_md, weights), None, repeats, warmup)[0],
    ]


def main(argv):
  del argv
  from absl import flags

  from experiments import runs

  FLAGS = flags.FLAGS
  runs.print_header(['tokamax'] if 'tokamax' in FLAGS.impls else [])  # the optional package a run uses
  print(
    f'{FLAGS.tokens} tokens, d_model {FLAGS.d_model}; median (min) of {FLAGS.repeats} calls in ms after '
    f'{FLAGS.warmup}; TFLOP/s over the active FLOPs'
  )
  _print_table(
    [
      'config',
      'impl',
      'MoE forward',
      'MoE forward+backward',
      'dense forward',
      'dense forward+backward',
      'MoE / dense (fwd+bwd)',
    ],
    layer_rows(
      FLAGS.configs,
      FLAGS.impls,
      FLAGS.tokens,
      FLAGS.d_model,
      FLAGS.shared,
      FLAGS.dtype,
      FLAGS.repeats,
      FLAGS.warmup,
      FLAGS.moe_tiles,
      FLAGS.profile_dir,
    ),
  )
  common = (FLAGS.configs, FLAGS.impls, FLAGS.tokens, FLAGS.d_model, FLAGS.dtype, FLAGS.repeats, FLAGS.warmup)
  if FLAGS.parts:
    _print_table(['config', 'part', 'impl', 'forward', 'forward+backward'], part_rows(*common, FLAGS.moe_tiles))
  header = ['config', 'A x B', 'impl', 'forward', 'input gradient', 'weight gradient', 'sum / dense sum']
  if FLAGS.matmuls:
    _print_table(header, matmul_rows(*common, FLAGS.moe_tiles))
  if FLAGS.kernels:
    _print_table(header, matmul_rows(*common, FLAGS.moe_tiles, alone=True))


def _print_table(header, rows):
  """A Markdown table, each row printed as it comes (a run cut short still shows what it measured)."""
  print('\n| ' + ' | '.join(header) + ' |\n' + '|---' * len(header) + '|', flush=True)
  for row in rows:
    print('| ' + ' | '.join(row) + ' |', flush=True)


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
