"""How far each KDA implementation's output, final state and gradients are from a float32 reference.

    python -m experiments.tools.kda_accuracy                        # GPU: (2, 1000, 4, 128), bf16; fla too
    python -m experiments.tools.kda_accuracy --seq_len=4096 --batch=8 --heads=16   # the benchmark shape
    python -m experiments.tools.kda_accuracy --batch=1 --seq_len=80 --heads=2 --head_dim=16   # CPU (interpreted)

The call is the KDA layer's (kimijax.ops.kda.kda with a_log= and dt_bias=, the gate formed from
its pre-activation f), with an initial state and the final state returned; --nogated passes a
float32 log-decay g instead. Inputs: q, k unit vectors, v ~ N(0, 1), beta ~ U(0, 1), s0 ~ N(0, 1),
f ~ N(0, --f_std), A_log and dt_bias from the layer's initialisers (decays near -0.01 to -0.2
per token). Each implementation (--impls: 'pallas', 'xla', 'xla_recurrent', and fla's Triton
`chunk_kda` where PyTorch sees a GPU) runs on the inputs in --dtype; the reference is
impl='xla' (the chunkwise form) on the same values cast to float32 under matmul precision 'highest'. The loss is a
fixed random linear functional of (o, final state), so every gradient is that of one scalar.

Prints one Markdown row per implementation: the relative RMSE (||x - x_ref|| / ||x_ref||, as
fla's tests measure) of o, the final state and each gradient. The gradients of A_log [H] and
dt_bias [H, K] are sums over every token (and feature, for A_log) of one head, so they show
what rounding in the backward does to a long reduction.

Expected (one H200, bf16, the default shape): pallas's output at a relative RMSE of about 4e-3 from the
reference, chunk's about 2e-3; every figure: experiments/results/bench_kda.md.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from experiments.cli import usage_error

flags.DEFINE_integer('batch', 2, 'B')
flags.DEFINE_integer('seq_len', 1000, 'T (any: the implementations pad the tail)')
flags.DEFINE_integer('heads', 4, 'H')
flags.DEFINE_integer('head_dim', 128, 'K = V')
flags.DEFINE_string('dtype', 'bfloat16', 'dtype of q, k, v, beta and f (states and the gate parameters: float32)')
flags.DEFINE_list('impls', ['pallas', 'xla', 'fla'], "what to measure: kimijax impls and 'fla'")
flags.DEFINE_bool('gated', True, "the gate from its pre-activation inside the op (the KDA layer's call)")
flags.DEFINE_float('f_std', 0.5, 'standard deviation of the gate pre-activation f')
flags.DEFINE_integer('seed', 0, 'seed of the inputs')
FLAGS = flags.FLAGS

NAMES = ('q', 'k', 'v', 'f', 'beta', 'initial_state', 'a_log', 'dt_bias')


def inputs(shape, *, gated: bool, f_std: float, seed: int) -> dict[str, np.ndarray]:
  """float32 NumPy inputs: q, k, v, f (or g), beta, initial_state, w_o, w_s, and with gated a_log, dt_bias."""
  import jax

  from kimijax.layers.kda import a_log_init, dt_bias_init

  b, t, h, d = shape
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  x = {
    'q': unit(rng.normal(size=shape)),
    'k': unit(rng.normal(size=shape)),
    'v': rng.normal(size=shape),
    'f': rng.normal(size=shape) * f_std if gated else -np.exp(rng.uniform(-7.0, 0.5, size=shape)),
    'beta': rng.uniform(size=(b, t, h)),
    'initial_state': rng.normal(size=(b, h, d, d)),
    'w_o': rng.normal(size=shape),
    'w_s': rng.normal(size=(b, h, d, d)),
  }
  if gated:
    keys = jax.random.split(jax.random.key(seed), 2)
    x['a_log'] = np.asarray(a_log_init(keys[0], (h,), np.float32))
    x['dt_bias'] = np.asarray(dt_bias_init(keys[1], (h, d), np.float32))
  return {k: np.asarray(v, np.float32) for k, v in x.items()}


def _jax_outputs(impl: str, x: dict, dtype) -> list[np.ndarray]:
  """[o, final state, gradients in NAMES' order] of kimijax's impl, float32 NumPy."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import kda as kda_lib

  names = [n for n in NAMES if n in x]
  low = lambda n: n in ('q', 'k', 'v', 'beta') or (n == 'f' and 'a_log' in x)  # g stays float32
  args = [jnp.asarray(x[n], dtype if low(n) else jnp.float32) for n in names]

  def loss(*a):
    kw = dict(zip(names, a))
    o, s = kda_lib.kda(
      kw['q'],
      kw['k'],
      kw['v'],
      kw['f'],
      kw['beta'],
      impl=impl,
      initial_state=kw['initial_state'],
      output_final_state=True,
      a_log=kw.get('a_log'),
      dt_bias=kw.get('dt_bias'),
    )
    return jnp.sum(o.astype(jnp.float32) * x['w_o']) + jnp.sum(s * x['w_s']), (o, s)

  (_, (o, s)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)
  return [np.asarray(jnp.asarray(y, jnp.float32)) for y in (o, s, *grads)]


def _fla_outputs(x: dict) -> list[np.ndarray] | str:
  """The same from fla's chunk_kda (bf16 inputs, the gate in its kernel), or why it was skipped."""
  try:
    import torch
    from fla.ops.kda import chunk_kda
  except ImportError as e:
    return f'skipped ({e})'
  if not torch.cuda.is_available():
    return 'skipped (no CUDA device for PyTorch)'
  gated = 'a_log' in x
  low = ('q', 'k', 'v', 'beta') + (('f',) if gated else ())
  t = {n: torch.tensor(x[n], device='cuda') for n in NAMES if n in x}
  t = {n: (v.bfloat16() if n in low else v).requires_grad_() for n, v in t.items()}
  kw = dict(A_log=t['a_log'], dt_bias=t['dt_bias'].reshape(-1), use_gate_in_kernel=True) if gated else {}
  o, s = chunk_kda(
    t['q'], t['k'], t['v'], t['f'], t['beta'], initial_state=t['initial_state'], output_final_state=True, **kw
  )
  w_o, w_s = (torch.tensor(x[n], device='cuda') for n in ('w_o', 'w_s'))
  ((o.float() * w_o).sum() + (s.float() * w_s).sum()).backward()
  return [y.float().cpu().numpy() for y in [o, s] + [t[n].grad for n in NAMES if n in t]]


def rel_rmse(a: np.ndarray, ref: np.ndarray) -> float:
  return float(np.linalg.norm((a - ref).ravel()) / max(np.linalg.norm(ref.ravel()), 1e-30))


def errors(shape, dtype_name: str, impls, *, gated: bool = True, f_std: float = 0.5, seed: int = 0):
  """({impl: [relative RMSE of o, final state, each gradient] or why skipped}, column names)."""
  import jax
  import jax.numpy as jnp

  x = inputs(shape, gated=gated, f_std=f_std, seed=seed)
  with jax.default_matmul_precision('highest'):
    ref = _jax_outputs('xla', x, jnp.float32)
  columns = ['o', 'final state'] + ['d' + ('g' if n == 'f' and not gated else n) for n in NAMES if n in x]
  out = {}
  for impl in impls:
    ys = _fla_outputs(x) if impl == 'fla' else _jax_outputs(impl, x, jnp.dtype(dtype_name))
    out[impl] = ys if isinstance(ys, str) else [rel_rmse(y, r) for y, r in zip(ys, ref)]
  return out, columns


def main(argv):
  del argv
  import jax

  shape = (FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.head_dim)
  from kimijax.ops import kda as kda_lib

  for impl in FLAGS.impls:
    if impl != 'fla' and impl not in kda_lib.IMPLS:
      usage_error(f'--impls: {impl!r} is unknown; allowed: {tuple(kda_lib.IMPLS)} and fla')
  print(f'jax {jax.__version__}; backend {jax.default_backend()}; device {jax.devices()[0].device_kind}')
  print(
    f'shape B, T, H, K=V = {shape}; inputs {FLAGS.dtype}; gated {FLAGS.gated}; relative RMSE against '
    "impl='xla' in float32 (matmul precision 'highest')\n"
  )
  result, columns = errors(shape, FLAGS.dtype, FLAGS.impls, gated=FLAGS.gated, f_std=FLAGS.f_std, seed=FLAGS.seed)
  print('| implementation | ' + ' | '.join(columns) + ' |')
  print('|---' * (len(columns) + 1) + '|')
  for impl, row in result.items():
    cells = [row] if isinstance(row, str) else ['%.2e' % e for e in row]
    print(f'| {impl} | ' + ' | '.join(cells) + ' |', flush=True)


if __name__ == '__main__':
  app.run(main)
