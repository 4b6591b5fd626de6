"""Tests for kimijax.ops.kda against a float64 NumPy transcription of SPEC §1 (tests/oracles.py).

The reference `ref_kda` is a plain loop over time in float64 that never calls the code under test;
its gradient is itself checked against central finite differences. kda_recurrent and kda_chunk are
then each compared with it, with each other (forward and all six gradients) and with kda_step
token by token. Relative errors are ||a - b|| / ||b|| over a whole tensor.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.ops import attention as attention_ops, attnres as attnres_ops, kda as kda_lib

from oracles import ref_kda

# One jitted entry point per function: one compile per shape is much cheaper than op-by-op dispatch.
recurrent = jax.jit(kda_lib.kda_recurrent, static_argnames=('scale', 'output_final_state'))
chunk = jax.jit(kda_lib.kda_chunk, static_argnames=('scale', 'output_final_state', 'chunk_size'))
step = jax.jit(kda_lib.kda_step, static_argnames=('scale',))


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  """GPUs run float32 matmuls as TF32 by default; these tests compare at ~1e-5."""
  with jax.default_matmul_precision('highest'):
    yield


def make_inputs(seed, b, t, h, dk, dv, *, g_min=-1.0, g_mode='uniform', dtype=np.float32):
  """L2-normalised q, k; v ~ N(0, 1); g in [g_min, 0]; beta in (0, 1); s0 ~ N(0, 1)."""
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q = unit(rng.normal(size=(b, t, h, dk)))
  k = unit(rng.normal(size=(b, t, h, dk)))
  v = rng.normal(size=(b, t, h, dv))
  if g_mode == 'uniform':
    g = rng.uniform(g_min, 0.0, size=(b, t, h, dk))
  elif g_mode == 'mixed':   # per channel either no decay (g = 0) or g = g_min
    g = np.where(rng.uniform(size=(1, 1, h, dk)) < 0.5, 0.0, g_min) * np.ones((b, t, h, dk))
  else:   # 'spikes': uniform in [g_min, 0] with 10% of the entries -1000 (a channel reset)
    g = rng.uniform(g_min, 0.0, size=(b, t, h, dk))
    g = np.where(rng.uniform(size=g.shape) < 0.1, -1000.0, g)
  beta = rng.uniform(0.0, 1.0, size=(b, t, h))
  s0 = rng.normal(size=(b, h, dk, dv))
  return tuple(np.asarray(x, dtype) for x in (q, k, v, g, beta, s0))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize('with_state', [False, True])
def test_both_forms_match_float64_reference(with_state):
  q, k, v, g, beta, s0 = make_inputs(0, 2, 37, 2, 16, 24)
  s0 = s0 if with_state else None
  o_ref, s_ref = ref_kda(q, k, v, g, beta, 16 ** -0.5, s0)
  for fn in (recurrent, functools.partial(chunk, chunk_size=16)):
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert o.shape == o_ref.shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert rel(o, o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


def test_custom_scale_matches_reference():
  q, k, v, g, beta, _ = make_inputs(1, 1, 20, 2, 16, 16)
  o_ref, _ = ref_kda(q, k, v, g, beta, 0.3)
  for fn in (recurrent, functools.partial(chunk, chunk_size=16)):
    assert rel(fn(q, k, v, g, beta, scale=0.3)[0], o_ref) < 1e-5


@pytest.mark.parametrize('t', [1, 63, 100, 130])
@pytest.mark.parametrize('chunk_size', [64, 16])
def test_chunk_equals_recurrent(t, chunk_size):
  q, k, v, g, beta, s0 = make_inputs(t, 2, t, 3, 16, 24)
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  o_c, s_c = chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=chunk_size)
  assert o_c.shape == (2, t, 3, 24) and s_c.shape == (2, 3, 16, 24)
  assert rel(o_c, o_r) <= 1e-5 and rel(s_c, s_r) <= 1e-5


def test_chunk_without_initial_state_and_final_state():
  q, k, v, g, beta, _ = make_inputs(3, 2, 100, 2, 16, 24)
  o_r, s_r = recurrent(q, k, v, g, beta, output_final_state=True)
  for c in (64, 16):
    o_c, none = chunk(q, k, v, g, beta, chunk_size=c)
    assert none is None and rel(o_c, o_r) <= 1e-5
  assert recurrent(q, k, v, g, beta)[1] is None


@pytest.mark.parametrize('g_mode,tol', [('uniform', 1e-5), ('mixed', 1e-5), ('spikes', 2e-5)])
def test_strong_decay_stays_finite_and_exact(g_mode, tol):
  """g down to -20 (exp(G) ~ 1e-556 over a chunk): no exp of a positive number, so no inf/NaN.

  'spikes' adds g = -1000 entries; the chunk form then loses a little precision inside 16-token
  sub-chunks (differences of cumulative sums of magnitude ~1000: ~5e-6 measured), hence 2e-5.
  """
  q, k, v, g, beta, s0 = make_inputs(4, 1, 130, 2, 16, 24, g_min=-20.0, g_mode=g_mode)
  o_ref, s_ref = ref_kda(q, k, v, g, beta, 16 ** -0.5, s0)
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  assert rel(o_r, o_ref) <= 1e-5 and rel(s_r, s_ref) <= 1e-5
  for c in (64, 16):
    o_c, s_c = chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, chunk_size=c)
    assert np.all(np.isfinite(o_c)) and np.all(np.isfinite(s_c))
    assert rel(o_c, o_r) <= tol and rel(s_c, s_r) <= tol
    assert rel(o_c, o_ref) <= tol and rel(s_c, s_ref) <= tol


def test_step_token_by_token_equals_recurrent():
  q, k, v, g, beta, s0 = make_inputs(5, 2, 20, 2, 16, 24)
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  s = jnp.asarray(s0)
  outs = []
  for i in range(q.shape[1]):
    o, s = step(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
    assert o.shape == (2, 2, 24) and s.dtype == jnp.float32
    outs.append(o)
  assert rel(jnp.stack(outs, 1), o_r) < 1e-6 and rel(s, s_r) < 1e-6


def test_bf16_inputs_give_bf16_output_and_fp32_state():
  q, k, v, g, beta, s0 = make_inputs(6, 1, 40, 2, 16, 16)
  lo = lambda x: jnp.asarray(x, jnp.bfloat16)
  args = (lo(q), lo(k), lo(v), jnp.asarray(g), lo(beta))
  o_ref, _ = ref_kda(*(np.asarray(jnp.asarray(x, jnp.float32)) for x in args), 16 ** -0.5, s0)
  for fn in (recurrent, chunk):
    o, s = fn(*args, initial_state=s0, output_final_state=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel(o, o_ref) < 1e-2


def test_dispatch():
  q, k, v, g, beta, s0 = make_inputs(7, 1, 30, 2, 16, 16)
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  for impl in ('recurrent', 'chunk'):
    o, s = kda_lib.kda(q, k, v, g, beta, impl=impl, initial_state=s0, output_final_state=True,
                       chunk_size=16)
    assert rel(o, o_r) <= 1e-5 and rel(s, s_r) <= 1e-5


# ----------------------------------------------------------------------------- gradients


def _loss(fn, w_o, w_s):
  """A fixed random linear functional of the output and the final state."""
  def loss(q, k, v, g, beta, s0):
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)
  return loss


def test_reference_gradient_matches_finite_differences():
  """jax.grad of kda_recurrent vs central differences of the float64 NumPy reference, all inputs."""
  q, k, v, g, beta, s0 = make_inputs(8, 1, 6, 2, 3, 2, g_min=-2.0)
  rng = np.random.default_rng(9)
  w_o, w_s = rng.normal(size=(1, 6, 2, 2)), rng.normal(size=(1, 2, 3, 2))
  args = [np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0)]

  def ref_loss(a):
    o, s = ref_kda(*a[:5], 3 ** -0.5, a[5])
    return np.sum(o * w_o) + np.sum(s * w_s)

  grads = jax.jit(jax.grad(_loss(kda_lib.kda_recurrent, w_o, w_s), argnums=tuple(range(6))))(
      *(jnp.asarray(x, jnp.float32) for x in args))
  eps = 1e-6
  for i, (x, gr) in enumerate(zip(args, grads)):
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
      plus = [a.copy() for a in args]
      minus = [a.copy() for a in args]
      plus[i][idx] += eps
      minus[i][idx] -= eps
      fd[idx] = (ref_loss(plus) - ref_loss(minus)) / (2 * eps)
    assert rel(gr, fd) < 1e-4, ('q', 'k', 'v', 'g', 'beta', 'initial_state')[i]


@pytest.mark.parametrize('t,chunk_size,g_min', [(100, 16, -1.0), (130, 64, -1.0), (70, 32, -20.0)])
def test_chunk_gradients_equal_recurrent(t, chunk_size, g_min):
  q, k, v, g, beta, s0 = make_inputs(10 + t, 2, t, 2, 16, 24, g_min=g_min)
  rng = np.random.default_rng(11)
  w_o, w_s = rng.normal(size=v.shape), rng.normal(size=s0.shape)
  argnums = tuple(range(6))
  g_rec = jax.jit(jax.grad(_loss(kda_lib.kda_recurrent, w_o, w_s), argnums=argnums))(
      q, k, v, g, beta, s0)
  chunk_fn = functools.partial(kda_lib.kda_chunk, chunk_size=chunk_size)
  g_chk = jax.jit(jax.grad(_loss(chunk_fn, w_o, w_s), argnums=argnums))(q, k, v, g, beta, s0)
  for name, a, b in zip(('q', 'k', 'v', 'g', 'beta', 'initial_state'), g_chk, g_rec):
    assert np.all(np.isfinite(a)), name
    assert rel(a, b) <= 1e-4, (name, rel(a, b))


# ----------------------------------------------------------------------------- memory


def _grad_temp_bytes(fn, t, h, d):
  """Compiled (not run) temp buffer bytes of grad through fn at B=1, T=t, H=h, K=V=d."""
  spec = jax.ShapeDtypeStruct
  x = spec((1, t, h, d), jnp.float32)
  loss = lambda q, k, v, g, beta: jnp.sum(fn(q, k, v, g, beta)[0])
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(
      x, x, x, x, spec((1, t, h), jnp.float32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunk_backward_memory_is_not_per_token_states():
  """The backward must not keep a [K, V] state per token: its temp memory grows by far less than
  K*V*4 bytes per added token and head (the recurrence, for contrast, grows by more)."""
  h, d = 1, 128
  per_token_state = d * d * 4
  rec_4k, rec_8k = (_grad_temp_bytes(kda_lib.kda_recurrent, t, h, d) for t in (4096, 8192))
  chunk_4k, chunk_8k = (_grad_temp_bytes(kda_lib.kda_chunk, t, h, d) for t in (4096, 8192))
  assert (rec_8k - rec_4k) / (4096 * h) >= per_token_state               # the check can see it
  assert (chunk_8k - chunk_4k) / (4096 * h) < 0.25 * per_token_state      # measured ~0.14
  assert chunk_8k < 0.25 * 8192 * h * per_token_state


# ----------------------------------------------------------------------------- errors


def _good(t=8, dk=4, dv=6):
  q, k, v, g, beta, s0 = make_inputs(12, 2, t, 3, dk, dv)
  return dict(q=q, k=k, v=v, g=g, beta=beta), s0


@pytest.mark.parametrize('fn', [kda_lib.kda_recurrent, kda_lib.kda_chunk])
@pytest.mark.parametrize('field,shape,match', [
    ('q', (2, 8, 3), r'q must be \[B, T, H, K\], got shape \[2, 8, 3\]'),
    ('k', (2, 8, 3, 5), r'q, k and g must have the same shape .* k \[2, 8, 3, 5\]'),
    ('g', (2, 8, 2, 4), r'q, k and g must have the same shape .* g \[2, 8, 2, 4\]'),
    ('v', (2, 7, 3, 6), r'v must be \[B, T, H, V\] with B, T, H = 2, 8, 3 .* got v \[2, 7, 3, 6\]'),
    ('beta', (2, 8, 3, 1), r'beta must be \[B, T, H\] = \[2, 8, 3\].* got beta \[2, 8, 3, 1\]'),
])
def test_shape_errors_name_the_shapes(fn, field, shape, match):
  args, _ = _good()
  args[field] = np.zeros(shape, np.float32)
  with pytest.raises(ValueError, match=match):
    fn(**args)


@pytest.mark.parametrize('fn', [kda_lib.kda_recurrent, kda_lib.kda_chunk])
def test_initial_state_and_dtype_errors(fn):
  args, s0 = _good()
  with pytest.raises(ValueError, match=r'initial_state must be \[B, H, K, V\] = \[2, 3, 4, 6\].*got \[2, 3, 6, 4\]'):
    fn(**args, initial_state=np.zeros((2, 3, 6, 4), np.float32))
  with pytest.raises(ValueError, match='beta must be a floating-point array, got dtype int32'):
    fn(**{**args, 'beta': np.ones((2, 8, 3), np.int32)}, initial_state=s0)


def test_chunk_size_error():
  args, _ = _good()
  for bad in (0, -16, 16.0):
    with pytest.raises(ValueError, match='chunk_size must be a positive int'):
      kda_lib.kda_chunk(**args, chunk_size=bad)


def test_step_errors():
  args, s0 = _good(t=1)
  one = {name: x[:, 0] for name, x in args.items()}
  with pytest.raises(ValueError, match=r'state must be \[B, H, K, V\] = \[2, 3, 4, 6\]; got \[2, 3, 4, 5\]'):
    kda_lib.kda_step(**one, state=np.zeros((2, 3, 4, 5), np.float32))
  with pytest.raises(ValueError, match=r'q must be \[B, H, K\] \(one token\)'):
    kda_lib.kda_step(**{**one, 'q': args['q']}, state=s0)
  with pytest.raises(ValueError, match=r'beta must be \[B, H\] = \[2, 3\]'):
    kda_lib.kda_step(**{**one, 'beta': args['beta']}, state=s0)


def test_dispatch_errors():
  args, _ = _good()
  with pytest.raises(ValueError, match=r"kda impl='flash' is unknown; allowed: \('recurrent', 'chunk'"):
    kda_lib.kda(**args, impl='flash')


@pytest.mark.parametrize('lower_bound', [0.0, -5.0])
def test_log_decay_gate_matches_float64_formula(lower_bound):
  """kda_log_decay against SPEC §1's gate in float64 NumPy, pre-activations from -60 to 60 (the
  softplus is evaluated without overflow at both ends); g <= 0 everywhere."""
  rng = np.random.default_rng(0)
  f = np.concatenate([rng.normal(size=(1, 6, 2, 8)) * 3, np.linspace(-60, 60, 96).reshape(1, 6, 2, 8)], axis=1)
  a_log, dt_bias = np.log(rng.uniform(1, 16, size=2)), rng.normal(size=(2, 8)) - 3
  f, a_log, dt_bias = (np.float32(x) for x in (f, a_log, dt_bias))
  x = f.astype(np.float64) + dt_bias
  a = np.exp(a_log.astype(np.float64))[:, None]
  arg = a * x if lower_bound else x            # the argument of the exp that sets g's size
  want = lower_bound * np.exp(-np.logaddexp(0.0, -arg)) if lower_bound else -a * np.logaddexp(0.0, x)
  got = kda_lib.kda_log_decay(jnp.asarray(f), jnp.asarray(a_log), jnp.asarray(dt_bias), lower_bound)
  assert got.dtype == jnp.float32 and np.all(np.asarray(got) <= 0)
  # float32 rounds the argument by |arg| 2^-24 or so, which e^arg turns into that relative error
  rtol = 2e-6 + 2.4e-7 * np.abs(arg)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= rtol * np.abs(want) + 1e-37)


def test_gated_call_equals_log_decay_then_kda():
  """kda(f, a_log=, dt_bias=) under the XLA forms is kda(kda_log_decay(f, ...)), gradients
  reaching a_log and dt_bias (against jax's derivative of the gate written with jax.nn.softplus)."""
  q, k, v, f, beta, s0 = make_inputs(3, 1, 20, 2, 16, 16)
  rng = np.random.default_rng(1)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, size=2)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(2, 16)) - 3, jnp.float32)

  def loss(impl, a_log, dt_bias, gated):
    if gated:
      o, _ = kda_lib.kda(q, k, v, f, beta, impl=impl, a_log=a_log, dt_bias=dt_bias, chunk_size=16)
    else:
      g = -jnp.exp(a_log)[:, None] * jax.nn.softplus(f + dt_bias)
      o, _ = kda_lib.kda(q, k, v, g, beta, impl=impl, chunk_size=16)
    return jnp.sum(o * jnp.cos(jnp.arange(o.size).reshape(o.shape)))

  for impl in ('recurrent', 'chunk'):
    got = jax.grad(functools.partial(loss, impl, gated=True), argnums=(0, 1))(a_log, dt_bias)
    want = jax.grad(functools.partial(loss, impl, gated=False), argnums=(0, 1))(a_log, dt_bias)
    for x, y in zip(got, want):
      assert rel(x, y) <= 1e-5, impl


def test_gate_errors_name_the_arrays():
  args, _ = _good()
  h, dk = args['q'].shape[2], args['q'].shape[3]
  with pytest.raises(ValueError, match=r'a_log and dt_bias come together .* got a_log alone'):
    kda_lib.kda(**args, a_log=jnp.zeros(h))
  with pytest.raises(ValueError, match=r'dt_bias \[H, K\] = \[%d, %d\]; got a_log \[%d\], dt_bias \[%d\]'
                     % (h, dk, h, dk)):
    kda_lib.kda(**args, a_log=jnp.zeros(h), dt_bias=jnp.zeros(dk))
  with pytest.raises(ValueError, match=r'gate_lower_bound must be a number <= 0'):
    kda_lib.kda(**args, a_log=jnp.zeros(h), dt_bias=jnp.zeros((h, dk)), gate_lower_bound=2.0)


@pytest.mark.parametrize('key,impls', [('kda_impl', kda_lib.IMPLS), ('attn_impl', attention_ops.IMPLS),
                                       ('attnres_impl', attnres_ops.IMPLS)], ids=['kda', 'attn', 'attnres'])
def test_config_allows_exactly_the_implementations_the_ops_hold(key, impls):
  """The ops' dicts are the config's allowed names: each one validates, and any other name (a
  kernel not built yet included) is one error naming the key and the allowed names."""
  for name in impls:
    c = config_lib.base_config()
    c.model[key] = name
    config_lib.validate(c)
  for name in ('pallas', 'flash'):
    if name in impls:
      continue
    c = config_lib.base_config()
    c.model[key] = name
    with pytest.raises(config_lib.ConfigError, match=rf"model.{key}='{name}' is not allowed; "
                                                     rf"allowed values: \[{', '.join(map(repr, impls))}\]"):
      config_lib.validate(c)
