"""Tests for kimijax.ops.attention against a float64 NumPy transcription (tests/oracles.py).

The reference never calls the code under test: forward, per-head max logit (docs/optimizers.md#qk-clip) and the
analytic softmax-attention backward are written out in NumPy, and the backward itself is
checked against central finite differences of the NumPy forward. One suite runs every
implementation in IMPLS against it (the GPU ones, gpu_only, in bf16 and marked gpu); the portable
'xla' form is then tested at odd shapes (MHA, GQA, MQA, T < S, one decode step) and edge cases.
"""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import impl_params
from jax.sharding import NamedSharding, PartitionSpec as P
from oracles import ref_attention, ref_attention_grads, ref_expand_kv, ref_max_logits, ref_max_logits_fast

from kimijax.ops import attention as attention_lib

# Jitted entry points: one compile per shape is much cheaper on CPU than op-by-op dispatch.
attention = jax.jit(attention_lib.attention, static_argnames=('causal', 'impl', 'return_max_logits'))
max_logits_blocked = jax.jit(attention_lib.max_logits_blocked, static_argnames=('causal', 'block'))


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  """GPUs run float32 matmuls as TF32 by default; these tests compare with float64 at ~1e-5."""
  with jax.default_matmul_precision('highest'):
    yield


def rand(rng, *shape):
  return rng.standard_normal(shape).astype(np.float32)


def make_qkv(seed, b, t, s, h, hkv, d):
  rng = np.random.default_rng(seed)
  return rand(rng, b, t, h, d), rand(rng, b, s, hkv, d), rand(rng, b, s, hkv, d)


# (B, T, S, H, Hkv, D, causal): MHA / GQA / MQA, causal or not, T == S and T < S, odd lengths.
CASES = [
  (2, 7, 7, 4, 4, 8, True),  # MHA, causal, odd T == S
  (2, 9, 9, 6, 2, 8, True),  # GQA (3 query heads per kv head), causal
  (2, 5, 11, 4, 2, 8, True),  # GQA, causal, T < S: queries are the last 5 of 11
  (2, 1, 6, 4, 2, 8, True),  # one decode step against a cache
  (2, 5, 5, 2, 2, 4, False),  # MHA, not causal
  (1, 3, 10, 4, 1, 6, False),  # MQA, not causal, T < S
]
CASE_IDS = [f'B{c[0]}T{c[1]}S{c[2]}H{c[3]}kv{c[4]}D{c[5]}{"causal" if c[6] else "full"}' for c in CASES]


# ----------------------------------------------------------------------------- the reference itself


def test_reference_backward_matches_finite_differences():
  """Guards the NumPy backward used below: central differences of the NumPy forward."""
  for causal, (t, s) in itertools.product((True, False), ((3, 3), (2, 4))):
    q, k, v = (x.astype(np.float64) for x in make_qkv(1, 1, t, s, 4, 2, 3))
    d_out = np.random.default_rng(2).standard_normal((1, t, 4, 3))
    grads = ref_attention_grads(q, k, v, d_out, causal)
    for idx, x in enumerate((q, k, v)):
      fd = np.zeros_like(x)
      for pos in np.ndindex(x.shape):
        args = [q, k, v]
        plus, minus = x.copy(), x.copy()
        plus[pos] += 1e-6
        minus[pos] -= 1e-6
        args[idx] = plus
        f_plus = (ref_attention(*args, causal)[0] * d_out).sum()
        args[idx] = minus
        f_minus = (ref_attention(*args, causal)[0] * d_out).sum()
        fd[pos] = (f_plus - f_minus) / 2e-6
      np.testing.assert_allclose(grads[idx], fd, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------- every implementation


# (B, T, S, H, Hkv, D): shapes every implementation takes (head dim 64, GQA 4:1; T < S, and odd)
SUITE_CASES = [(2, 128, 128, 8, 2, 64), (2, 78, 256, 8, 2, 64), (2, 77, 256, 8, 2, 64)]


@pytest.mark.parametrize('case', SUITE_CASES, ids=lambda c: 'B{}T{}S{}H{}kv{}D{}'.format(*c))
@pytest.mark.parametrize('impl', impl_params(attention_lib.IMPLS))
def test_every_impl_matches_float64_reference(impl, case):
  """Output, exact max logits and gradients against float64 on the same inputs: float32 for the
  portable form, bf16 (bf16 tolerances) for the GPU implementations. Gradients at even lengths
  only (JAX's cuDNN backward raises NotImplementedError for odd sequence lengths)."""
  b, t, s, h, hkv, d = case
  gpu = attention_lib.IMPLS[impl].gpu_only
  dtype = jnp.bfloat16 if gpu else jnp.float32
  q, k, v = (jnp.asarray(x, dtype) for x in make_qkv(12, b, t, s, h, hkv, d))
  q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  out, max_logits = attention(q, k, v, causal=True, impl=impl, return_max_logits=True)
  assert out.shape == (b, t, h, d) and out.dtype == dtype and max_logits.dtype == jnp.float32
  tol = 2e-2 if gpu else 1e-5
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_attention(q64, k64, v64, True)[0], rtol=tol, atol=tol)
  np.testing.assert_allclose(max_logits, ref_max_logits_fast(q64, k64, True), rtol=1e-5, atol=1e-6)
  if t % 2 or s % 2:
    return
  d_out = jnp.asarray(rand(np.random.default_rng(13), b, t, h, d), dtype)
  loss = lambda q, k, v: jnp.sum((attention(q, k, v, causal=True, impl=impl) * d_out).astype(jnp.float32))
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  ref = ref_attention_grads(q64, k64, v64, np.asarray(d_out.astype(jnp.float32), np.float64), True)
  for name, g, r in zip('qkv', grads, ref):
    g = np.asarray(g.astype(jnp.float32))
    assert np.max(np.abs(g - r)) <= (3e-2 if gpu else 1e-4) * np.max(np.abs(r)), name


# ----------------------------------------------------------------------------- 'xla': forward and max logits


@pytest.mark.parametrize('b,t,s,h,hkv,d,causal', CASES, ids=CASE_IDS)
def test_forward_and_max_logits_match_reference(b, t, s, h, hkv, d, causal):
  q, k, v = make_qkv(0, b, t, s, h, hkv, d)
  out, max_logits = attention(q, k, v, causal=causal, impl='xla', return_max_logits=True)
  ref_out, _ = ref_attention(q, k, v, causal)
  assert out.shape == (b, t, h, d) and out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
  assert max_logits.shape == (h,) and max_logits.dtype == jnp.float32
  np.testing.assert_allclose(max_logits, ref_max_logits(q, k, causal), rtol=1e-5, atol=1e-6)
  # Without return_max_logits the result is the bare output array.
  plain = attention(q, k, v, causal=causal, impl='xla')
  assert isinstance(plain, jax.Array)
  np.testing.assert_array_equal(plain, out)


def test_causal_mask_changes_output():
  """Guards the causal cases above from passing vacuously."""
  q, k, v = make_qkv(0, 2, 6, 6, 4, 2, 8)
  causal = attention(q, k, v, causal=True)
  full = attention(q, k, v, causal=False)
  assert np.max(np.abs(np.asarray(causal) - np.asarray(full))) > 1e-2
  np.testing.assert_allclose(causal[:, -1], full[:, -1], rtol=1e-5, atol=1e-6)  # last query sees all


@pytest.mark.parametrize('t,s', [(6, 6), (3, 8)])
def test_max_logits_are_signed_when_all_logits_are_negative(t, s):
  """All q . k < 0: a max clamped at 0, or one that lets masked fill values in, would fail."""
  rng = np.random.default_rng(3)
  q = np.abs(rand(rng, 2, t, 4, 8)) + 0.1
  k = -np.abs(rand(rng, 2, s, 2, 8)) - 0.1
  v = rand(rng, 2, s, 2, 8)
  ref = ref_max_logits(q, k, causal=True)
  assert np.all(ref < -0.1)
  _, max_logits = attention(q, k, v, causal=True, return_max_logits=True)
  np.testing.assert_allclose(max_logits, ref, rtol=1e-5)


@pytest.mark.parametrize('t,s', [(7, 7), (4, 9)])
def test_max_logits_ignore_the_masked_upper_triangle(t, s):
  """The largest raw logit sits at a masked (query, key) pair; the max must not see it."""
  rng = np.random.default_rng(4)
  q = np.abs(rand(rng, 2, t, 4, 8)) + 0.5
  q[:, -1] = -q[:, -1]  # the only query that sees the last key: negative logit
  k = 0.1 * rand(rng, 2, s, 2, 8)
  k[:, -1] = 3.0  # huge logit with every earlier query, all masked
  v = rand(rng, 2, s, 2, 8)
  scale = 8**-0.5
  raw_max = (np.einsum('bthd,bshd->bhts', q.astype(np.float64), ref_expand_kv(k, 4)) * scale).max(axis=(0, 2, 3))
  ref = ref_max_logits(q, k, causal=True)
  assert np.all(raw_max > ref + 1.0)
  _, max_logits = attention(q, k, v, causal=True, return_max_logits=True)
  np.testing.assert_allclose(max_logits, ref, rtol=1e-5, atol=1e-6)
  # Not causal: the masked pair counts.
  _, max_full = attention(q, k, v, causal=False, return_max_logits=True)
  np.testing.assert_allclose(max_full, raw_max, rtol=1e-5)


def test_max_logits_carry_no_gradient():
  q, k, v = make_qkv(5, 1, 4, 4, 2, 2, 4)
  grads = jax.grad(lambda q, k: attention(q, k, v, return_max_logits=True)[1].sum(), argnums=(0, 1))(q, k)
  for g in grads:
    np.testing.assert_array_equal(g, 0.0)


# ----------------------------------------------------------------------------- 'xla': gradients


@pytest.mark.parametrize('b,t,s,h,hkv,d,causal', CASES, ids=CASE_IDS)
def test_gradients_match_reference(b, t, s, h, hkv, d, causal):
  q, k, v = make_qkv(6, b, t, s, h, hkv, d)
  d_out = rand(np.random.default_rng(7), b, t, h, d)
  loss = lambda q, k, v: jnp.sum(attention(q, k, v, causal=causal, impl='xla') * d_out)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  ref = ref_attention_grads(q, k, v, d_out, causal)
  for name, g, r in zip('qkv', grads, ref):
    assert g.shape == r.shape, name
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5, err_msg=f'd/d{name}')


# ----------------------------------------------------------------------------- the max-logit kernel per shard


@pytest.mark.parametrize(
  'mesh_shape,axes,spec',
  [
    ((4, 2), ('data', 'fsdp'), P(('data', 'fsdp'), None, None, None)),
    ((2, 2, 2), ('data', 'fsdp', 'tensor'), P(('data', 'fsdp'), None, 'tensor', None)),
  ],
  ids=['data4_fsdp2', 'data2_fsdp2_tensor2'],
)
def test_max_logit_kernel_runs_per_shard_under_a_mesh(mesh_shape, axes, spec):
  """On the 8 fake devices, q and k sharded over the batch (and the heads over 'tensor') as the
  attention layers lay them out: the fused kernel (interpreted) runs on each device's shard,
  [B / 8 or B / 4, T, H or H / 2, D], and the per-head maxima are reduced across the batch shards. The
  result is the float64 max logit, and the compiled program gathers neither q nor k."""
  b, t, h, hkv, d = 8, 24, 4, 2, 16
  rng = np.random.default_rng(3)
  q = (rng.normal(size=(b, t, h, d)) - 0.5).astype(np.float32)
  k = rng.normal(size=(b, t, hkv, d)).astype(np.float32)
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  q_sh, k_sh = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k))
  run = jax.jit(lambda q, k: attention_lib.max_logits_kernel(q, k, causal=True, spec=spec))
  with jax.set_mesh(mesh):
    got = run(q_sh, k_sh)
    lowered = run.lower(q_sh, k_sh)
  np.testing.assert_allclose(got, ref_max_logits_fast(q, k, True), rtol=1e-5, atol=1e-5)
  local_b, local_h = b // (mesh.shape['data'] * mesh.shape['fsdp']), h // mesh.shape.get('tensor', 1)
  body = lowered.as_text()[lowered.as_text().index('sdy.manual_computation') :]
  assert re.search(rf'\(%arg\d+: tensor<{local_b}x{t}x{local_h}x{d}xf32>', body), 'q should arrive per shard'
  compiled = lowered.compile().as_text()
  assert 'all-gather' not in compiled and 'all-to-all' not in compiled
  assert 'all-reduce' in compiled  # the max across the batch shards


# ----------------------------------------------------------------------------- max_logits_blocked


@pytest.mark.parametrize('block', [1, 3, 4, 5, 7, 12, 512])
@pytest.mark.parametrize('t,s,causal', [(12, 12, True), (12, 17, True), (12, 12, False)])
def test_max_logits_blocked_matches_reference(block, t, s, causal):
  """Blocks that divide T (1, 3, 4, 12), that do not (5, 7), and larger than T (512)."""
  q, k, _ = make_qkv(8, 2, t, s, 6, 3, 8)
  got = max_logits_blocked(q, k, causal=causal, block=block)
  assert got.shape == (6,)
  np.testing.assert_allclose(got, ref_max_logits(q, k, causal), rtol=1e-5, atol=1e-6)


def test_max_logits_blocked_ignores_padding_rows_with_negative_logits():
  """Padded query rows give logit 0; with all real logits negative they must not win."""
  rng = np.random.default_rng(9)
  q = np.abs(rand(rng, 1, 7, 2, 4)) + 0.1
  k = -np.abs(rand(rng, 1, 7, 2, 4)) - 0.1
  ref = ref_max_logits(q, k, causal=True)
  assert np.all(ref < 0)
  np.testing.assert_allclose(max_logits_blocked(q, k, causal=True, block=3), ref, rtol=1e-5)


# ----------------------------------------------------------------------------- errors


Q, KV = (2, 5, 4, 8), (2, 5, 2, 8)


@pytest.mark.parametrize(
  'q_shape,k_shape,v_shape,named',
  [
    (Q[:3], KV, KV, 'qkv'),  # q not 4-D
    (Q, (2, 5, 2, 6), (2, 5, 2, 6), 'kv'),  # head dim of k differs from q's
    (Q, KV, (2, 6, 2, 8), 'kv'),  # k and v lengths differ
    (Q, (3, 5, 2, 8), (3, 5, 2, 8), 'kv'),  # batch differs
    (Q, (2, 5, 3, 8), (2, 5, 3, 8), 'qk'),  # kv heads do not divide query heads
  ],
)
def test_shape_errors_name_the_shapes(q_shape, k_shape, v_shape, named):
  q, k, v = (jnp.zeros(sh, jnp.float32) for sh in (q_shape, k_shape, v_shape))
  with pytest.raises(ValueError) as err:
    attention_lib.attention(q, k, v)
  msg = str(err.value)
  for name in named:
    shape = {'q': q_shape, 'k': k_shape, 'v': v_shape}[name]
    assert str(shape) in msg, (name, msg)


@pytest.mark.parametrize('impl', ['pallas', 'flash', ''])
def test_unknown_impl_raises_naming_allowed(impl):
  q, k, v = make_qkv(0, 1, 4, 4, 2, 2, 4)
  with pytest.raises(ValueError, match='allowed') as err:
    attention_lib.attention(q, k, v, impl=impl)
  assert repr(impl) in str(err.value)
  assert "'xla'" in str(err.value) and "'cudnn'" in str(err.value)


def test_cudnn_rejects_float32():
  q, k, v = make_qkv(0, 1, 4, 4, 2, 2, 4)
  with pytest.raises(ValueError, match='bfloat16'):
    attention_lib.attention(q, k, v, impl='cudnn')


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize(
  't,s,hkv,causal',
  [(256, 256, 8, True), (255, 255, 2, True), (78, 256, 2, True), (77, 256, 2, True), (77, 256, 2, False)],
)
def test_cudnn_bf16_matches_reference(t, s, hkv, causal):
  """T < S (the last T of S positions) needs the bottom-right causal mask passed explicitly."""
  b, h, d = 2, 8, 64
  q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in make_qkv(10, b, t, s, h, hkv, d))
  q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
  ref_out, _ = ref_attention(q64, k64, v64, causal)
  out, m_cudnn = attention(q, k, v, causal=causal, impl='cudnn', return_max_logits=True)
  assert out.dtype == jnp.bfloat16 and m_cudnn.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out, np.float32), ref_out, rtol=2e-2, atol=2e-2)
  _, m_xla = attention(q, k, v, causal=causal, impl='xla', return_max_logits=True)
  np.testing.assert_array_equal(np.asarray(m_cudnn), np.asarray(m_xla))
  np.testing.assert_allclose(m_cudnn, ref_max_logits_fast(q64, k64, causal), rtol=1e-5)
  if t % 2 or s % 2:
    return  # JAX's cuDNN backward raises NotImplementedError for odd sequence lengths
  # Gradients through the fused kernel, bf16 tolerance.
  d_out = jnp.asarray(rand(np.random.default_rng(11), b, t, h, d), jnp.bfloat16)
  loss = lambda q, k, v: jnp.sum((attention(q, k, v, causal=causal, impl='cudnn') * d_out).astype(jnp.float32))
  grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  ref = ref_attention_grads(q64, k64, v64, np.asarray(d_out.astype(jnp.float32), np.float64), causal)
  for name, g, r in zip('qkv', grads, ref):
    g = np.asarray(g.astype(jnp.float32))
    assert np.max(np.abs(g - r)) <= 3e-2 * np.max(np.abs(r)), name
