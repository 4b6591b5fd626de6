"""Tests for kimijax.ops.kda against a float64 NumPy transcription of docs/kda.md (tests/oracles.py).

The reference `ref_kda` is a plain loop over time in float64 that never calls the code under test.
One suite runs every implementation in IMPLS ('xla', 'xla_recurrent', 'pallas'; the Pallas kernels
interpreted on the CPU, so small shapes with power-of-two head dims) against it: forward, final
state, decode steps, bf16, strong decays, the gated call, and all gradients against central finite
differences of the reference (longer sequences: against jax.grad of the recurrence, which those
finite differences check). Then the chunk form's own parameters (chunk_size, memory), the gate's
formula and the errors. Relative errors are ||a - b|| / ||b|| over a whole tensor. The kernels'
internals (tiles, steep sub-chunks, settings, lowering for an H200) are tested in
tests/kernels_pallas/test_kda_kernels.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import impl_params
from oracles import np_conv, np_sigmoid, np_silu, ref_kda

from kimijax.ops import kda as kda_lib

# One jitted entry point per function: one compile per shape is much cheaper than op-by-op dispatch.
recurrent = jax.jit(kda_lib.kda_recurrent, static_argnames=('scale', 'output_final_state'))
chunk = jax.jit(kda_lib.kda_chunk, static_argnames=('scale', 'output_final_state', 'chunk_size'))

IMPLS = impl_params(kda_lib.IMPLS)
REFERENCE = 'xla_recurrent'  # the recurrence: what longer sequences' gradients are compared with
# Relative error each implementation keeps against the float64 reference in float32 (the fused
# kernels round a few more intermediates: their chunk's products, the blockwise inverse).
TOL = {'xla': 1e-5, 'xla_recurrent': 1e-5, 'pallas': 1e-4}


@functools.cache
def kda_fn(impl):
  """kda under impl, jitted; 'xla' with 16-token chunks (the other implementations ignore it)."""
  return jax.jit(
    functools.partial(kda_lib.kda, impl=impl, chunk_size=16),
    static_argnames=('scale', 'output_final_state', 'gate_lower_bound'),
  )


@functools.cache
def step_fn(impl):
  return jax.jit(functools.partial(kda_lib.kda_step, impl=impl))


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
  elif g_mode == 'mixed':  # per channel either no decay (g = 0) or g = g_min
    g = np.where(rng.uniform(size=(1, 1, h, dk)) < 0.5, 0.0, g_min) * np.ones((b, t, h, dk))
  else:  # 'spikes': uniform in [g_min, 0] with 10% of the entries -1000 (a channel reset)
    g = rng.uniform(g_min, 0.0, size=(b, t, h, dk))
    g = np.where(rng.uniform(size=g.shape) < 0.1, -1000.0, g)
  beta = rng.uniform(0.0, 1.0, size=(b, t, h))
  s0 = rng.normal(size=(b, h, dk, dv))
  return tuple(np.asarray(x, dtype) for x in (q, k, v, g, beta, s0))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- every implementation


@pytest.mark.parametrize('with_state', [False, True])
@pytest.mark.parametrize('impl', IMPLS)
def test_forward_matches_float64_reference(impl, with_state):
  """T = 37: one chunk of 64 and a tail for the kernels, three chunks of 16 and a tail for 'xla'."""
  q, k, v, g, beta, s0 = make_inputs(0, 2, 37, 2, 16, 32)
  s0 = s0 if with_state else None
  o_ref, s_ref = ref_kda(q, k, v, g, beta, 16**-0.5, s0)
  o, s = kda_fn(impl)(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  assert o.shape == o_ref.shape and o.dtype == jnp.float32 and s.dtype == jnp.float32
  assert rel(o, o_ref) < TOL[impl] and rel(s, s_ref) < TOL[impl]
  assert kda_fn(impl)(q, k, v, g, beta, initial_state=s0)[1] is None


@pytest.mark.parametrize('impl', IMPLS)
def test_custom_scale_matches_reference(impl):
  q, k, v, g, beta, _ = make_inputs(1, 1, 20, 2, 16, 16)
  o_ref, _ = ref_kda(q, k, v, g, beta, 0.3)
  assert rel(kda_fn(impl)(q, k, v, g, beta, scale=0.3)[0], o_ref) < TOL[impl]


@pytest.mark.parametrize('g_mode,tol', [('uniform', 1e-5), ('mixed', 1e-5), ('spikes', 2e-5)])
@pytest.mark.parametrize('impl', IMPLS)
def test_strong_decay_stays_finite_and_exact(impl, g_mode, tol):
  """g down to -20 (exp(G) ~ 1e-556 over a chunk): no exp of a positive number, so no inf/NaN.

  'spikes' adds g = -1000 entries; the chunk form then loses a little precision inside 16-token
  sub-chunks (differences of cumulative sums of magnitude ~1000: ~5e-6 measured), hence 2e-5.
  The kernels form such steep sub-chunks pair by pair (tests/kernels_pallas/test_kda_kernels.py).
  """
  q, k, v, g, beta, s0 = make_inputs(4, 1, 130, 2, 16, 32, g_min=-20.0, g_mode=g_mode)
  o_ref, s_ref = ref_kda(q, k, v, g, beta, 16**-0.5, s0)
  tol = max(tol, TOL[impl])
  runs = [functools.partial(chunk, chunk_size=c) for c in (64, 16)] if impl == 'xla' else [kda_fn(impl)]
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  for run in runs:
    o, s = run(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(s))
    assert rel(o, o_ref) <= tol and rel(s, s_ref) <= tol
    assert rel(o, o_r) <= tol and rel(s, s_r) <= tol


@pytest.mark.parametrize('g_mode', ['uniform', 'spikes'])
@pytest.mark.parametrize('impl', IMPLS)
def test_step_token_by_token_equals_recurrent(impl, g_mode):
  """kda_step under impl ('pallas': one fused kernel), token by token from an initial state,
  against the recurrence over the whole sequence and the float64 reference."""
  q, k, v, g, beta, s0 = make_inputs(5, 2, 20, 2, 16, 32, g_mode=g_mode)
  o_r, s_r = recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)
  o_ref, s_ref = ref_kda(q, k, v, g, beta, 16**-0.5, s0)
  s = jnp.asarray(s0)
  outs = []
  for i in range(q.shape[1]):
    o, s = step_fn(impl)(q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i], s)
    assert o.shape == (2, 2, 32) and s.dtype == jnp.float32
    outs.append(o)
  assert rel(jnp.stack(outs, 1), o_r) < 1e-6 and rel(s, s_r) < 1e-6
  assert rel(jnp.stack(outs, 1), o_ref) < 1e-5 and rel(s, s_ref) < 1e-5


@pytest.mark.parametrize('short_conv', [True, False], ids=['conv', 'no_conv'])
@pytest.mark.parametrize('lower_bound', [0.0, -5.0])
@pytest.mark.parametrize('impl', IMPLS)
def test_decode_token_by_token_equals_the_float64_layer_mixing(impl, lower_bound, short_conv):
  """kda_decode ('pallas': one kernel, here two value blocks per head, and the composed form with the
  step kernel) token by token from zero conv prefixes and a random state, against float64: the
  causal short convolutions and their activations over the whole sequence, beta's sigmoid,
  docs/kda.md's gate and the recurrence; the last prefixes are the last W-1 inputs."""
  b, t, h, dk, dv, width = 2, 6, 2, 16, 32, 4
  rng = np.random.default_rng(7)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  xs = (normal(b, t, h, dk), normal(b, t, h, dk), normal(b, t, h, dv))
  f, beta_logit, s0 = normal(b, t, h, dk), normal(b, t, h), normal(b, h, dk, dv)
  a_log, dt_bias = np.log(rng.uniform(1, 16, h)).astype(np.float32), 0.5 * normal(h, dk)
  taps = tuple(0.5 * normal(width, h, x.shape[-1]) for x in xs)
  conv = lambda x, w: np_conv(x, w) if short_conv else np.asarray(x, np.float64)
  l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
  q, k, v = (conv(x, w) for x, w in zip(xs, taps))
  q, k, v = l2(np_silu(q)), l2(np_silu(k)), np_silu(v)
  pre = np.asarray(f, np.float64) + dt_bias
  a = np.exp(np.asarray(a_log, np.float64))[:, None]
  g = lower_bound * np_sigmoid(a * pre) if lower_bound else -a * np.log1p(np.exp(pre))
  o_ref, s_ref = ref_kda(q, k, v, g, np_sigmoid(np.asarray(beta_logit, np.float64)), dk**-0.5, s0)

  # 'pallas': the one kernel and (fused_decode=0) the XLA convs and gates before the step kernel
  variants = ['value_block_step=16', 'value_block_step=16/fused_decode=0'] if impl == 'pallas' else [None]
  for text in variants:
    settings = None if text is None else kda_lib.IMPLS[impl].parse_settings(text)
    decode = jax.jit(functools.partial(kda_lib.kda_decode, impl=impl, settings=settings, gate_lower_bound=lower_bound))
    conv_args = {}
    if short_conv:
      conv_args = dict(prefixes=tuple(np.zeros((b, width - 1, h, x.shape[-1]), np.float32) for x in xs), taps=taps)
    s, outs = s0, []
    for i in range(t):
      inputs = (*(x[:, i] for x in xs), f[:, i], beta_logit[:, i], s)
      o, s, prefixes = decode(*inputs, a_log=a_log, dt_bias=dt_bias, **conv_args)
      if short_conv:
        conv_args['prefixes'] = prefixes
      else:
        assert prefixes is None
      outs.append(o)
    assert rel(jnp.stack(outs, 1), o_ref) < 1e-5 and rel(s, s_ref) < 1e-5, text
    if short_conv:
      for x, p in zip(xs, prefixes):
        np.testing.assert_array_equal(p, x[:, t - width + 1 :])


@pytest.mark.parametrize('impl', IMPLS)
def test_bf16_inputs_give_bf16_output_and_fp32_state(impl):
  q, k, v, g, beta, s0 = make_inputs(6, 1, 40, 2, 16, 16)
  lo = lambda x: jnp.asarray(x, jnp.bfloat16)
  args = (lo(q), lo(k), lo(v), jnp.asarray(g), lo(beta))
  o_ref, _ = ref_kda(*(np.asarray(jnp.asarray(x, jnp.float32)) for x in args), 16**-0.5, s0)
  o, s = kda_fn(impl)(*args, initial_state=s0, output_final_state=True)
  assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
  assert rel(o, o_ref) < 1e-2


def _loss(fn, w_o, w_s):
  """A fixed random linear functional of the output and the final state."""

  def loss(q, k, v, g, beta, s0):
    o, s = fn(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    return jnp.sum(o * w_o) + jnp.sum(s * w_s)

  return loss


@pytest.mark.parametrize('impl', IMPLS)
def test_gradients_match_float64_finite_differences(impl):
  """jax.grad under impl against central differences of the float64 reference, in every input
  (initial_state included), at T = 6: one small chunk."""
  q, k, v, g, beta, s0 = make_inputs(8, 1, 6, 1, 16, 16, g_min=-2.0)
  rng = np.random.default_rng(9)
  w_o, w_s = rng.normal(size=(1, 6, 1, 16)), rng.normal(size=(1, 1, 16, 16))
  args = [np.asarray(x, np.float64) for x in (q, k, v, g, beta, s0)]

  def ref_loss(a):
    o, s = ref_kda(*a[:5], 16**-0.5, a[5])
    return np.sum(o * w_o) + np.sum(s * w_s)

  grads = jax.jit(jax.grad(_loss(kda_fn(impl), w_o, w_s), argnums=tuple(range(6))))(
    *(jnp.asarray(x, jnp.float32) for x in args)
  )
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


@pytest.mark.parametrize('impl', [p for p in IMPLS if p.values[0] != REFERENCE])
def test_gradients_equal_recurrent_with_tail_state_and_resets(impl):
  """Two chunks of the kernels (the second a tail of 36 tokens), an initial state and decays of
  -1000 mixed in: output, final state and all six gradients equal the recurrence's."""
  q, k, v, g, beta, s0 = make_inputs(0, 1, 100, 2, 32, 16, g_mode='spikes')
  rng = np.random.default_rng(0)
  w_o, w_s = rng.normal(size=v.shape), rng.normal(size=s0.shape)
  argnums = tuple(range(6))
  (o, s), (o_r, s_r) = (
    f(q, k, v, g, beta, initial_state=s0, output_final_state=True) for f in (kda_fn(impl), recurrent)
  )
  assert rel(o, o_r) <= 1e-4 and rel(s, s_r) <= 1e-4
  g_rec = jax.jit(jax.grad(_loss(kda_lib.kda_recurrent, w_o, w_s), argnums=argnums))(q, k, v, g, beta, s0)
  got = jax.jit(jax.grad(_loss(kda_fn(impl), w_o, w_s), argnums=argnums))(q, k, v, g, beta, s0)
  for name, a, b in zip(('q', 'k', 'v', 'g', 'beta', 'initial_state'), got, g_rec):
    assert np.all(np.isfinite(a)), name
    assert rel(a, b) <= 1e-4, (name, rel(a, b))


@pytest.mark.parametrize('lower_bound', [0.0, -3.0])
@pytest.mark.parametrize('impl', IMPLS)
def test_gated_call_equals_the_gate_then_the_recurrence(impl, lower_bound):
  """kda(f, a_log=, dt_bias=) ('pallas': the gate inside the cumulative-sum kernels) against the
  recurrence on g from jax.nn's softplus or sigmoid, differentiated by jax: T = 40 (the kernels pad
  it to a chunk of 64: the padded rows must not decay the final state), an initial state; the
  output, the final state and all eight gradients, each in its input's dtype."""
  q, k, v, _, beta, s0 = make_inputs(4, 1, 40, 2, 16, 16)
  rng = np.random.default_rng(4)
  f = jnp.asarray(rng.normal(size=q.shape) * 2.0, jnp.float32)
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, size=2)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(2, 16)) - 2.0, jnp.float32)
  w_o, w_s = jnp.asarray(rng.normal(size=v.shape), jnp.float32), jnp.asarray(rng.normal(size=s0.shape), jnp.float32)

  def gated(q, k, v, f, beta, s0, a_log, dt_bias):
    return kda_fn(impl)(
      q,
      k,
      v,
      f,
      beta,
      initial_state=s0,
      output_final_state=True,
      a_log=a_log,
      dt_bias=dt_bias,
      gate_lower_bound=lower_bound,
    )

  def reference(q, k, v, f, beta, s0, a_log, dt_bias):
    x = f + dt_bias
    a = jnp.exp(a_log)[:, None]
    g = lower_bound * jax.nn.sigmoid(a * x) if lower_bound else -a * jax.nn.softplus(x)
    return kda_lib.kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)

  def value_and_grads(fn, args):
    def loss(*a):
      o, s = fn(*a)
      return jnp.sum(o.astype(jnp.float32) * w_o) + jnp.sum(s * w_s), (o, s)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True))(*args)

  args = (q, k, v, f, beta, s0, a_log, dt_bias)
  (_, (o, s)), grads = value_and_grads(gated, args)
  (_, (o_r, s_r)), grads_r = value_and_grads(reference, args)
  assert rel(o, o_r) <= TOL[impl] and rel(s, s_r) <= TOL[impl]
  for name, a, b, x in zip(('q', 'k', 'v', 'f', 'beta', 'initial_state', 'a_log', 'dt_bias'), grads, grads_r, args):
    assert a.dtype == jnp.asarray(x).dtype, name
    assert rel(a, b) <= TOL[impl], (name, rel(a, b))


# ----------------------------------------------------------------------------- the chunk form ('xla')


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


@pytest.mark.parametrize('t,chunk_size,g_min', [(100, 16, -1.0), (130, 64, -1.0), (70, 32, -20.0)])
def test_chunk_gradients_equal_recurrent(t, chunk_size, g_min):
  q, k, v, g, beta, s0 = make_inputs(10 + t, 2, t, 2, 16, 24, g_min=g_min)
  rng = np.random.default_rng(11)
  w_o, w_s = rng.normal(size=v.shape), rng.normal(size=s0.shape)
  argnums = tuple(range(6))
  g_rec = jax.jit(jax.grad(_loss(kda_lib.kda_recurrent, w_o, w_s), argnums=argnums))(q, k, v, g, beta, s0)
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
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, x, x, x, spec((1, t, h), jnp.float32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunk_backward_memory_is_not_per_token_states():
  """The backward must not keep a [K, V] state per token: its temp memory grows by far less than
  K*V*4 bytes per added token and head (the recurrence, for contrast, grows by more)."""
  h, d = 1, 128
  per_token_state = d * d * 4
  rec_4k, rec_8k = (_grad_temp_bytes(kda_lib.kda_recurrent, t, h, d) for t in (4096, 8192))
  chunk_4k, chunk_8k = (_grad_temp_bytes(kda_lib.kda_chunk, t, h, d) for t in (4096, 8192))
  assert (rec_8k - rec_4k) / (4096 * h) >= per_token_state  # the check can see it
  assert (chunk_8k - chunk_4k) / (4096 * h) < 0.25 * per_token_state  # measured ~0.14
  assert chunk_8k < 0.25 * 8192 * h * per_token_state


# ----------------------------------------------------------------------------- errors


def _good(t=8, dk=4, dv=6):
  q, k, v, g, beta, s0 = make_inputs(12, 2, t, 3, dk, dv)
  return dict(q=q, k=k, v=v, g=g, beta=beta), s0


@pytest.mark.parametrize('fn', [kda_lib.kda_recurrent, kda_lib.kda_chunk])
@pytest.mark.parametrize(
  'field,shape,match',
  [
    ('q', (2, 8, 3), r'q must be \[B, T, H, K\], got shape \[2, 8, 3\]'),
    ('k', (2, 8, 3, 5), r'q, k and g must have the same shape .* k \[2, 8, 3, 5\]'),
    ('g', (2, 8, 2, 4), r'q, k and g must have the same shape .* g \[2, 8, 2, 4\]'),
    ('v', (2, 7, 3, 6), r'v must be \[B, T, H, V\] with B, T, H = 2, 8, 3 .* got v \[2, 7, 3, 6\]'),
    ('beta', (2, 8, 3, 1), r'beta must be \[B, T, H\] = \[2, 8, 3\].* got beta \[2, 8, 3, 1\]'),
  ],
)
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


def test_decode_errors_name_the_arrays():
  args, s0 = _good(t=1)
  one = {name: x[:, 0] for name, x in args.items()}
  q, k, v, f, beta_logit = one['q'], one['k'], one['v'], one['g'], one['beta']
  gate = dict(a_log=np.zeros(3, np.float32), dt_bias=np.zeros((3, 4), np.float32))
  b, h, dk, dv = 2, 3, 4, 6
  prefixes = (np.zeros((b, 3, h, dk), np.float32),) * 2 + (np.zeros((b, 3, h, dv), np.float32),)
  taps = (np.zeros((4, h, dk), np.float32),) * 2 + (np.zeros((4, h, dv), np.float32),)
  with pytest.raises(ValueError, match=r'kda_decode: state must be \[B, H, K, V\] = \[2, 3, 4, 6\]'):
    kda_lib.kda_decode(q, k, v, f, beta_logit, np.zeros((2, 3, 4, 5), np.float32), **gate)
  with pytest.raises(
    ValueError, match=r'kda_decode: beta_logit must be \[B, H\] = \[2, 3\]; got beta_logit \[2, 3, 1\]'
  ):
    kda_lib.kda_decode(q, k, v, f, beta_logit[..., None], s0, **gate)
  with pytest.raises(ValueError, match=r'kda_decode: q, k and f must have the same shape .* f \[2, 3, 5\]'):
    kda_lib.kda_decode(q, k, v, np.zeros((2, 3, 5), np.float32), beta_logit, s0, **gate)
  with pytest.raises(ValueError, match=r'kda: the gate needs a_log \[H\] = \[3\]'):
    kda_lib.kda_decode(q, k, v, f, beta_logit, s0, a_log=np.zeros(2, np.float32), dt_bias=gate['dt_bias'])
  with pytest.raises(ValueError, match='prefixes and taps come together'):
    kda_lib.kda_decode(q, k, v, f, beta_logit, s0, **gate, prefixes=prefixes)
  with pytest.raises(
    ValueError, match=r'the v conv needs taps \[W, H, D\] = \[4, 3, 6\] and a prefix \[B, W-1, H, D\]'
  ):
    kda_lib.kda_decode(q, k, v, f, beta_logit, s0, **gate, prefixes=prefixes, taps=taps[:2] + (taps[0],))
  with pytest.raises(ValueError, match=r"kda_decode impl='flash' is unknown"):
    kda_lib.kda_decode(q, k, v, f, beta_logit, s0, **gate, impl='flash')


def test_dispatch_errors():
  args, s0 = _good()
  with pytest.raises(ValueError, match=r"kda impl='flash' is unknown; allowed: \('xla', 'xla_recurrent', 'pallas'\)"):
    kda_lib.kda(**args, impl='flash')
  one = {name: x[:, 0] for name, x in args.items()}
  with pytest.raises(ValueError, match=r"kda_step impl='flash' is unknown; allowed: \('xla', 'xla_recurrent'"):
    kda_lib.kda_step(**one, state=s0, impl='flash')


def test_pallas_rejects_head_dims_the_kernels_cannot_tile():
  q, k, v, g, beta, _ = make_inputs(2, 1, 16, 1, 24, 16)
  with pytest.raises(ValueError, match=r'K = 24 must be a power of two >= 16'):
    kda_lib.kda(q, k, v, g, beta, impl='pallas')


@pytest.mark.parametrize('lower_bound', [0.0, -5.0])
def test_log_decay_gate_matches_float64_formula(lower_bound):
  """kda_log_decay against docs/kda.md's gate in float64 NumPy, pre-activations from -60 to 60 (the
  softplus is evaluated without overflow at both ends); g <= 0 everywhere."""
  rng = np.random.default_rng(0)
  f = np.concatenate([rng.normal(size=(1, 6, 2, 8)) * 3, np.linspace(-60, 60, 96).reshape(1, 6, 2, 8)], axis=1)
  a_log, dt_bias = np.log(rng.uniform(1, 16, size=2)), rng.normal(size=(2, 8)) - 3
  f, a_log, dt_bias = (np.float32(x) for x in (f, a_log, dt_bias))
  x = f.astype(np.float64) + dt_bias
  a = np.exp(a_log.astype(np.float64))[:, None]
  arg = a * x if lower_bound else x  # the argument of the exp that sets g's size
  want = lower_bound * np.exp(-np.logaddexp(0.0, -arg)) if lower_bound else -a * np.logaddexp(0.0, x)
  got = kda_lib.kda_log_decay(jnp.asarray(f), jnp.asarray(a_log), jnp.asarray(dt_bias), lower_bound)
  assert got.dtype == jnp.float32 and np.all(np.asarray(got) <= 0)
  # float32 rounds the argument by |arg| 2^-24 or so, which e^arg turns into that relative error
  rtol = 2e-6 + 2.4e-7 * np.abs(arg)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= rtol * np.abs(want) + 1e-37)


def test_gate_errors_name_the_arrays():
  args, _ = _good()
  h, dk = args['q'].shape[2], args['q'].shape[3]
  with pytest.raises(ValueError, match=r'a_log and dt_bias come together .* got a_log alone'):
    kda_lib.kda(**args, a_log=jnp.zeros(h))
  with pytest.raises(
    ValueError, match=r'dt_bias \[H, K\] = \[%d, %d\]; got a_log \[%d\], dt_bias \[%d\]' % (h, dk, h, dk)
  ):
    kda_lib.kda(**args, a_log=jnp.zeros(h), dt_bias=jnp.zeros(dk))
  with pytest.raises(ValueError, match=r'gate_lower_bound must be a number <= 0'):
    kda_lib.kda(**args, a_log=jnp.zeros(h), dt_bias=jnp.zeros((h, dk)), gate_lower_bound=2.0)
