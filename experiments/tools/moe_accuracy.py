"""How far each grouped-matmul implementation's expert SwiGLU and its gradients are from float64.

    python -m experiments.tools.moe_accuracy                                   # GPU: every impl, bf16
    python -m experiments.tools.moe_accuracy --shapes=512x256x128x16x4 --impls=xla,xla_blocked   # CPU

Each shape 'TxDxFxExK' (tokens, d_model, expert hidden, experts, top-k) routes T random tokens to
their top-K of E experts (sigmoid, renormalised; experts 3 and 7 get no token), sorts the rows by
expert (kimijax.ops.moe.sort_by_expert / permute) and runs kimijax.ops.moe.expert_swiglu on them in
--dtype with each implementation (--impls, keys of kimijax.ops.moe.IMPLS). The loss is sum(y * dy)
for a fixed random dy, so every gradient is that of one scalar. The reference is an independent
float64 NumPy transcription of the same maths on the same (dtype-rounded) values: per expert,
h = silu(x W_gate) * (x W_up), y = h W_down, and the hand-written backward of those three products.

Prints one Markdown row per (shape, impl): the relative RMSE (||x - x_ref|| / ||x_ref||) of y and
of the gradients of x, W_gate, W_up and W_down. In bf16, rounding each output to bf16 alone gives
about 5e-3; tests/ops/test_moe_ops.py bounds the GPU implementations at 5e-3 (outputs) and 1e-2
(gradients). float32 runs at the highest matmul precision. Results: experiments/results/moe.md.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from experiments.cli import usage_error

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  flags.DEFINE_list('shapes', ['512x256x128x16x4', '8192x1024x512x64x8'], "'TxDxFxExK' shapes")
  flags.DEFINE_list('impls', ['xla', 'xla_blocked', 'tokamax'], 'keys of kimijax.ops.moe.IMPLS')
  flags.DEFINE_string('dtype', 'bfloat16', 'the operands dtype')
  flags.DEFINE_integer('seed', 0, 'random seed')


def parse_shape(name: str) -> tuple[int, int, int, int, int]:
  parts = name.split('x')
  if len(parts) != 5 or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--shapes entry {name!r} is not 'TxDxFxExK' (tokens, d_model, hidden, experts, top-k)")
  return tuple(int(p) for p in parts)


def reference(x_md, sizes_e, wg_edf, wu_edf, wd_efd, dy_md):
  """float64: (y, dx, dW_gate, dW_up, dW_down) of the rows sorted by expert (sizes_e rows each)."""
  x_md, wg_edf, wu_edf, wd_efd, dy_md = (np.asarray(a, np.float64) for a in (x_md, wg_edf, wu_edf, wd_efd, dy_md))
  y, dx = np.zeros_like(x_md), np.zeros_like(x_md)
  dwg, dwu, dwd = np.zeros_like(wg_edf), np.zeros_like(wu_edf), np.zeros_like(wd_efd)
  start = 0
  for e, size in enumerate(sizes_e):
    rows = slice(start, start + int(size))
    start += int(size)
    x, dy = x_md[rows], dy_md[rows]
    a, b = x @ wg_edf[e], x @ wu_edf[e]
    sig = 1.0 / (1.0 + np.exp(-a))
    h = a * sig * b
    y[rows] = h @ wd_efd[e]
    dh = dy @ wd_efd[e].T
    dwd[e] = h.T @ dy
    da = dh * b * sig * (1.0 + a * (1.0 - sig))  # d silu(a) / da = sig (1 + a (1 - sig))
    db = dh * a * sig
    dwg[e], dwu[e] = x.T @ da, x.T @ db
    dx[rows] = da @ wg_edf[e].T + db @ wu_edf[e].T
  return y, dx, dwg, dwu, dwd


def rel_rmse(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.sqrt(np.mean((got - want) ** 2) / max(np.mean(want**2), 1e-300)))


def measure(shape, impls, dtype, seed) -> list[dict]:
  import jax
  import jax.numpy as jnp

  from kimijax.ops import moe

  t, d, f, e, k = shape
  rng = np.random.default_rng(seed)
  cast = lambda a: jnp.asarray(a, jnp.float32).astype(dtype)
  x_td = cast(rng.standard_normal((t, d)))
  logits = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
  bias = jnp.zeros(e).at[jnp.asarray([3, 7])].set(-1e3)
  experts_tk = moe.route(logits, bias, top_k=k).experts_tk
  dispatch = moe.sort_by_expert(experts_tk, e)
  x_md = moe.permute(x_td, dispatch, k)
  ws = [cast(rng.standard_normal(s) * s[1] ** -0.5) for s in ((e, d, f), (e, d, f), (e, f, d))]
  dy_md = cast(rng.standard_normal((t * k, d)))
  sizes = np.asarray(dispatch.group_sizes_e)
  want = reference(x_md, sizes, *ws, dy_md)
  rows = []
  for impl in impls:
    problem = moe.unsupported(impl, dtype, d, f)
    if problem:
      rows.append({'shape': shape, 'impl': impl, 'skipped': problem})
      continue

    def loss(x, wg, wu, wd, impl=impl):
      y = moe.expert_swiglu(x, dispatch.group_sizes_e, wg, wu, wd, impl=impl)
      return jnp.sum(y.astype(jnp.float32) * dy_md.astype(jnp.float32)), y

    # float32 at full precision: a GPU would otherwise run float32 products as TF32.
    with jax.default_matmul_precision('highest' if dtype == 'float32' else 'default'):
      (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x_md, *ws)
    got = (y, *grads)
    names = ('y', 'x', 'w_gate', 'w_up', 'w_down')
    rows.append({'shape': shape, 'impl': impl, **{n: rel_rmse(g, w) for n, g, w in zip(names, got, want)}})
  return rows


def main(argv):
  del argv
  import jax

  try:
    shapes = [parse_shape(s) for s in FLAGS.shapes]
  except ValueError as e:
    usage_error(str(e))
  if FLAGS.dtype not in ('bfloat16', 'float16', 'float32'):
    usage_error(f"--dtype={FLAGS.dtype!r} is not one of 'bfloat16', 'float16', 'float32'")
  print(f'# devices: {jax.devices()}; dtype {FLAGS.dtype}; reference float64 NumPy\n')
  print('| T x D x F x E x K | impl | y | grad x | grad W_gate | grad W_up | grad W_down |')
  print('|---|---|---|---|---|---|---|')
  for shape in shapes:
    for row in measure(shape, FLAGS.impls, FLAGS.dtype, FLAGS.seed):
      name = 'x'.join(map(str, shape))
      if 'skipped' in row:
        print(f"| {name} | '{row['impl']}' | {row['skipped']} | | | | |")
      else:
        cells = ' | '.join(f'{row[n]:.2e}' for n in ('y', 'x', 'w_gate', 'w_up', 'w_down'))
        print(f"| {name} | '{row['impl']}' | {cells} |", flush=True)


if __name__ == '__main__':
  define_flags()
  app.run(main)
