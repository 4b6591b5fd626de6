"""Block-size sweep of the fused max-logit kernel (kernels_pallas/attention/max_logits.py) on the GPU.

    python -m experiments.bench.bench_max_logits
Prints ms per call at B=8, T=4096, H=8, D=128 (the bench_350m attention shape) for each setting,
next to cuDNN's causal attention forward on the same inputs.
"""

import itertools

import jax
import jax.numpy as jnp

from experiments import runs
from experiments.bench import timing
from kernels_pallas.attention.max_logits import max_logits


def timeit(fn, *args, n=20):
  return timing.loop_ms(lambda _: fn(*args), None, steps=n)[0]


def main():
  if jax.default_backend() != 'gpu':  # cuDNN's attention and the Triton kernel need one
    raise SystemExit(f'bench_max_logits needs an NVIDIA GPU; JAX runs on {jax.default_backend()!r} here')
  runs.print_header()
  b, t, h, d = 8, 4096, 8, 128
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, h, d), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, h, d), jnp.bfloat16)
  sdpa = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation='cudnn'))
  print(f'cudnn causal attention forward: {timeit(sdpa, q, k, v):.3f} ms')
  for bq, bk, warps, stages in itertools.product((64, 128), (64, 128), (4, 8), (2, 3)):
    fn = jax.jit(lambda q, k: max_logits(q, k, block_q=bq, block_k=bk, num_warps=warps, num_stages=stages))
    try:
      print(f'max_logits block_q={bq} block_k={bk} warps={warps} stages={stages}: {timeit(fn, q, k):.3f} ms')
    except Exception as e:  # a setting that does not fit in shared memory or registers
      print(f'max_logits block_q={bq} block_k={bk} warps={warps} stages={stages}: failed ({type(e).__name__})')


if __name__ == '__main__':
  main()
