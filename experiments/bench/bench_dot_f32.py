"""The MoE layer's two float32 products under Precision.HIGHEST and under the tensor-core algorithm
kimijax.ops.moe uses (F32_ALGORITHM, BF16_BF16_F32_X6), and the router as kimijax.ops.moe.router_logits
computes it for a bf16 x (the same products as X6 without splitting x: x against W_r's three bf16
terms in one GEMM): time and distance from HIGHEST.

    python -m experiments.bench.bench_dot_f32 [--tokens=65536 --d_model=1024 --experts=64 --blocks=320 --width=524288]

'router': the router logits x W_r (x bf16 [T, D], W_r float32 [D, E]) forward and backward, the
loss sum(sigmoid(u) * c); 'block sum': xla_blocked's backward summing the per-block weight
gradients per expert, one-hot [E, blocks] x [blocks, D 2F] float32. The defaults are
configs/bench_350m.py:moe's shapes at batch 16 (W_in's sum: D 2F = 1024 x 512). Prints a
Markdown table: product, algorithm, median (min) ms, relative RMSE against HIGHEST of each output.
"""

import jax
import jax.numpy as jnp
from absl import app, flags

from experiments.bench import timing
from experiments.tools.moe_accuracy import rel_rmse
from kimijax.ops.moe import F32_ALGORITHM, router_logits

ALGORITHMS = {'HIGHEST': jax.lax.Precision.HIGHEST, F32_ALGORITHM.name: F32_ALGORITHM}
ROUTER_LOGITS = 'router_logits (x against three terms of W_r)'


def rows(*, tokens, d_model, experts, blocks, width, repeats=20, warmup=2):
  """Yields (product, algorithm, 'median (min)' ms, relative RMSE of each output against HIGHEST's)."""
  kx, kw, kc, kd = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (tokens, d_model), jnp.bfloat16)
  w = jax.random.normal(kw, (d_model, experts), jnp.float32) * 0.02
  c = jax.random.normal(kc, (tokens, experts), jnp.float32)
  group = jnp.minimum(jnp.arange(blocks) * experts // blocks, experts - 1)
  one_hot = (group[None, :] == jnp.arange(experts)[:, None]).astype(jnp.float32)
  dw = jax.random.normal(kd, (blocks, width), jnp.float32)

  def router(precision):
    def loss(x, w):
      if precision == ROUTER_LOGITS:
        u = router_logits(x, w)
      else:
        u = jnp.matmul(x.astype(jnp.float32), w, precision=precision, preferred_element_type=jnp.float32)
      return jnp.sum(jax.nn.sigmoid(u) * c)

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    return lambda: fn(x, w)

  def block_sum(precision):
    fn = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision, preferred_element_type=jnp.float32))
    return lambda: fn(one_hot, dw)

  forms = {'router': {**ALGORITHMS, ROUTER_LOGITS: ROUTER_LOGITS}, 'block sum': ALGORITHMS}
  for product, make in (('router', router), ('block sum', block_sum)):
    reference = None
    for name, precision in forms[product].items():
      call = make(precision)
      median, fastest = timing.call_ms(call, repeats=repeats, warmup=warmup)
      out = jax.tree.leaves(call())
      reference = out if reference is None else reference
      errors = ', '.join(f'{rel_rmse(a, b):.1e}' for a, b in zip(out, reference))
      yield product, name, f'{median:.3f} ({fastest:.3f})', errors


def main(argv):
  del argv
  f = flags.FLAGS
  print('| product | algorithm | ms, median (min) | relative RMSE against HIGHEST |')
  print('|---|---|---|---|')
  for row in rows(tokens=f.tokens, d_model=f.d_model, experts=f.experts, blocks=f.blocks, width=f.width):
    print('| ' + ' | '.join(row) + ' |')


if __name__ == '__main__':
  flags.DEFINE_integer('tokens', 65536, 'tokens T of the router logits')
  flags.DEFINE_integer('d_model', 1024, 'D')
  flags.DEFINE_integer('experts', 64, 'E')
  flags.DEFINE_integer('blocks', 320, "xla_blocked's blocks")
  flags.DEFINE_integer('width', 1024 * 512, 'elements of one expert matrix (D 2F)')
  app.run(main)
