"""Diagnostic: what the phase-1 `grads` kernel of Block AttnRes spends its time on (GPU only).

    python -m experiments.tools.ablate_attnres_grads [--sources=8] [--queries=6] [--tiles=dc_grads=64]

Times kernels_pallas.attnres.phase1_backward.grads_kernel, then copies of it with parts of its work
left out, through the kernel's own pallas_call (phase1_backward.grads_call), on the bench_350m
shape (16 x 4096 tokens, D = 1024, bf16 sources), with random inputs and the default tiles or
--tiles (Phase1Settings; so the first row alone is a tile sweep's figure). The copies' outputs are wrong on
purpose; only their times mean something. Each figure is the median wall time of 20 jitted
calls (the launch included), so compare them with each other:
    dv_i = c_i v_i + dv_in_i + sum_j alpha_ji do_j + sum_j b_ji q_j,   dq += b_parts_i^T v_i
Results: experiments/results/bench_attnres.md.
"""

import functools

import jax
import jax.numpy as jnp
from absl import app, flags
from jax.experimental import pallas as pl

from kernels_pallas.attnres import bf16_split, phase1_backward
from kernels_pallas.attnres.settings import Phase1Settings

flags.DEFINE_integer('sources', 8, 'n, block sums')
flags.DEFINE_integer('queries', 6, 'S, consumers per block')
flags.DEFINE_integer('tokens', 16 * 4096, 'M')
flags.DEFINE_integer('d_model', 1024, 'D')
flags.DEFINE_string(
  'tiles',
  '',
  "phase-1 tiles, 'key=int/key=int' (the grads kernel's: bt_grads, rows_grads, dc_grads, warps_grads, stages_grads)",
)
FLAGS = flags.FLAGS

VARIANTS = {  # name: the terms kept (None: the kernel itself)
  'the kernel as it is': None,
  'without sum_j alpha_ji do_j (nor the do reads)': dict(alpha_do=False),
  'without sum_j b_ji q_j': dict(b_q=False),
  'without the dq dot': dict(dq=False),
  'without dv_in (nor its reads)': dict(dv_in=False),
  'dv_i = c_i v_i + dv_in_i + sum_j do_j, no dq: the memory traffic alone': dict(weights=False, dq=False),
}


def make_kernel(n, s, bt, alpha_do=True, b_q=True, dq=True, dv_in=True, weights=True):
  """grads_kernel (bf16 sources) with the named terms left out; weights=False sums the do_j
  unweighted (their reads stay, the alpha and b reads go)."""

  def kernel(*refs):
    k = n if dv_in else 0
    do, src, dv_prev = refs[:s], refs[s : s + n], refs[s + n : s + n + k]
    alpha_ref, b_ref, c_ref, q_ref, parts_ref = refs[s + n + k : s + n + k + 5]
    dv, (dq_ref,) = refs[s + n + k + 5 : s + 2 * n + k + 5], refs[s + 2 * n + k + 5 :]
    q = [q_ref[j, :][None, :] for j in range(s)]

    def step(t, carry):
      rows = pl.ds(t * bt, bt)
      dos = [do[j][rows, :].astype(jnp.float32) for j in range(s)] if alpha_do else []
      grads = []
      for i in range(n):
        grad = c_ref[i, rows][:, None] * src[i][rows, :].astype(jnp.float32)
        if dv_in:
          grad = grad + dv_prev[i][rows, :].astype(jnp.float32)
        for j in range(s):
          if alpha_do:
            grad = grad + (alpha_ref[i, j, rows][:, None] * dos[j] if weights else dos[j])
          if b_q and weights:
            grad = grad + b_ref[i, j, rows][:, None] * q[j]
        grads.append(grad.astype(dv[i].dtype))
      for i in range(n):
        dv[i][rows, :] = grads[i]
      return carry

    jax.lax.fori_loop(0, src[0].shape[0] // bt, step, 0)
    acc = jnp.zeros(dq_ref.shape, jnp.float32)
    if dq:
      for i in range(n):
        acc += jnp.dot(parts_ref[i], src[i][...], preferred_element_type=jnp.float32)
    dq_ref[...] = acc

  return kernel


def median_ms(fn, args, calls=20, warmup=3):
  from experiments.bench import timing

  return timing.call_ms(lambda: fn(*args), repeats=calls, warmup=warmup)[0]


def main(argv):
  del argv
  settings = Phase1Settings.from_string(FLAGS.tiles)
  if jax.default_backend() != 'gpu':
    raise SystemExit('ablate_attnres_grads.py times compiled Triton kernels: it needs a GPU')
  n, s, m, d = FLAGS.sources, FLAGS.queries, FLAGS.tokens, FLAGS.d_model
  keys = iter(jax.random.split(jax.random.key(0), 3 * n + s + 8))
  rand = lambda shape, dtype=jnp.bfloat16: jax.random.normal(next(keys), shape, jnp.float32).astype(dtype)
  width = bf16_split.dot_width(s)
  d_outs, sources, d_sources_in = ([rand((m, d)) for _ in range(k)] for k in (s, n, n))
  coefficients = (
    rand((n, s, m), jnp.float32),
    rand((n, s, m), jnp.float32),
    rand((n, m), jnp.float32),
    rand((s, d), jnp.float32),
    rand((n, width, m)),
  )
  print(
    f'| grads kernel, n = {n}, S = {s}, M = {m}, D = {d}, bf16, {jax.devices()[0].device_kind}'
    f'{", tiles " + FLAGS.tiles if FLAGS.tiles else ""} | ms per call |'
  )
  print('|---|---|')
  for name, parts in VARIANTS.items():
    if parts is None:
      kernel = functools.partial(
        phase1_backward.grads_kernel, n=n, s=s, bt=settings.bt_grads, accumulate=True, source_parts=1
      )
    else:
      kernel = make_kernel(n, s, settings.bt_grads, **parts)
    accumulated = d_sources_in if (parts or {}).get('dv_in', True) else []
    fn = jax.jit(lambda a, b, c, e, kernel=kernel: phase1_backward.grads_call(kernel, a, b, c, e, settings))
    print(f'| {name} | {median_ms(fn, (d_outs, sources, accumulated, coefficients)):.2f} |', flush=True)


if __name__ == '__main__':
  app.run(main)
