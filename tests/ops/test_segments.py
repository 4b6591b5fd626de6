"""Packed documents through the sequence ops (segment_ids, kimijax/ops/segments.py): attention, KDA
and the short convolution on a row of several documents give, token for token, the outputs of
each document run alone (the float64 oracles of tests/oracles.py applied per document) and the
gradients of running each document alone. Every implementation: attention 'xla' and the tokamax
wrapper (with tokamax's XLA reference op on the CPU; the Mosaic GPU kernel in the gpu tests), KDA
'xla', 'xla_recurrent' and 'pallas' (the kernels interpreted), the short conv 'xla' and 'pallas'.
The rows put document boundaries inside a 16-token sub-chunk, on sub-chunk edges and on the 64-token
chunk edge, and hold one-token documents. The GPU tests (marked gpu) compare the compiled kernels
with the 'xla' forms at bf16 tolerances (relative RMSE <= 5e-3 outputs, <= 1e-2 gradients).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import impl_params, rel_rmse, short_conv_inputs
from jax.sharding import NamedSharding, PartitionSpec as P
from oracles import (
  np_document_spans,
  np_each_document,
  np_short_conv,
  ref_attention,
  ref_attention_grads,
  ref_kda,
  ref_max_logits_fast,
)

from kimijax.ops import attention as attention_lib, kda as kda_lib, segments, short_conv as sc


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  with jax.default_matmul_precision('highest'):
    yield


def segment_ids(*rows):
  """[B, T] int32 from each row's document lengths: 1, 2, ... per document."""
  return np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in rows]).astype(np.int32)


# T = 128: row 0 opens documents at 5 (inside a sub-chunk), 32 (a sub-chunk edge), 64 (the chunk
# edge) and 100; row 1 at 1 and 2 (one-token documents), 16, 64 and 65.
KDA_SEGMENTS = segment_ids([5, 27, 32, 36, 28], [1, 1, 14, 48, 1, 63])
# T = 24 for attention and the conv: short documents, a one-token one, a row of one document.
SHORT_SEGMENTS = segment_ids([3, 1, 12, 8], [24])


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


# ----------------------------------------------------------------------------- the segment helpers


def test_segment_helpers_match_the_document_spans():
  ids = np.concatenate([KDA_SEGMENTS, 7 + KDA_SEGMENTS[:, ::-1]])  # any ids, runs of equal ones
  starts = np.zeros(ids.shape, bool)
  index = np.zeros(ids.shape, np.int32)
  for row, a, b in np_document_spans(ids):
    starts[row, a] = a > 0
    index[row, a:b] = a
  np.testing.assert_array_equal(segments.segment_starts(ids), starts)
  np.testing.assert_array_equal(segments.segment_start_index(ids), index)
  since = np.arange(ids.shape[1]) - index
  np.testing.assert_array_equal(segments.tokens_since_start(ids), since)
  np.testing.assert_array_equal(sc.conv_reach(ids, 4), np.where(index == 0, 3, np.minimum(since, 3)))


# ----------------------------------------------------------------------------- attention

ATTENTION_CASES = [(4, 4, 8, 8), (6, 2, 8, 8), (4, 4, 12, 8)]  # (H, Hkv, D, Dv): MHA, GQA, MLA-like
ATTENTION_IDS = ['mha', 'gqa', 'mla_dims']


def _attention_inputs(h, hkv, d, dv, seed=0):
  rng = np.random.default_rng(seed)
  b, t = SHORT_SEGMENTS.shape
  n = lambda *s: rng.standard_normal(s).astype(np.float32)
  return n(b, t, h, d), n(b, t, hkv, d), n(b, t, hkv, dv), n(b, t, h, dv)


def _check_attention(run, q, k, v, d_out):
  """run(q, k, v) -> (out, max_logits) with SHORT_SEGMENTS: out and the gradients of sum(out *
  d_out) against the float64 oracle per document; max_logits against the max over documents."""
  out, max_logits = run(q, k, v)
  each = lambda fn: np_each_document(fn, SHORT_SEGMENTS, q, k, v, d_out)
  np.testing.assert_allclose(out, each(lambda q, k, v, _: ref_attention(q, k, v, True)[0]), rtol=1e-5, atol=1e-5)
  per_document = [
    ref_max_logits_fast(q[r : r + 1, a:b], k[r : r + 1, a:b], True) for r, a, b in np_document_spans(SHORT_SEGMENTS)
  ]
  np.testing.assert_allclose(max_logits, np.max(per_document, axis=0), rtol=1e-5, atol=1e-6)
  grads = jax.grad(lambda q, k, v: jnp.sum(run(q, k, v)[0] * d_out), argnums=(0, 1, 2))(q, k, v)
  for i, (name, got) in enumerate(zip('qkv', grads)):
    want = each(lambda q, k, v, d, i=i: ref_attention_grads(q, k, v, d, True)[i])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=f'd/d{name}')


@pytest.mark.parametrize('h,hkv,d,dv', ATTENTION_CASES, ids=ATTENTION_IDS)
def test_xla_attention_on_packed_documents_equals_each_document_alone(h, hkv, d, dv):
  run = jax.jit(
    lambda q, k, v: attention_lib.attention(q, k, v, impl='xla', return_max_logits=True, segment_ids=SHORT_SEGMENTS)
  )
  _check_attention(run, *_attention_inputs(h, hkv, d, dv))


def _tokamax_reference(**kw):
  from tokamax._src.ops.attention import base

  return lambda q, k, v: attention_lib.flash_attention_tokamax(
    q, k, v, op=base.DotProductAttention(), return_max_logits=True, segment_ids=SHORT_SEGMENTS, **kw
  )


@pytest.mark.parametrize('h,hkv,d,dv', ATTENTION_CASES, ids=ATTENTION_IDS)
def test_tokamax_wrapper_on_packed_documents_equals_each_document_alone(h, hkv, d, dv):
  """The wrapper's k_start mask (each row's segment start) through tokamax's XLA reference op."""
  _check_attention(jax.jit(_tokamax_reference()), *_attention_inputs(h, hkv, d, dv))


def test_tokamax_wrapper_with_segments_runs_per_shard_under_a_mesh():
  """Batch over data x fsdp, heads over tensor: each device masks its own rows by their segments."""
  q, k, v, _ = _attention_inputs(4, 2, 8, 8, seed=1)
  reps = lambda x: np.concatenate([x] * 4)  # 8 rows: two per batch shard
  q, k, v = reps(q), reps(k), reps(v)
  ids = reps(SHORT_SEGMENTS)
  spec = P(('data', 'fsdp'), None, 'tensor', None)
  mesh = jax.make_mesh((2, 2, 2), ('data', 'fsdp', 'tensor'), axis_types=(jax.sharding.AxisType.Auto,) * 3)
  from tokamax._src.ops.attention import base

  run = jax.jit(
    lambda q, k, v, ids: attention_lib.flash_attention_tokamax(
      q, k, v, op=base.DotProductAttention(), return_max_logits=True, segment_ids=ids, spec=spec
    )
  )
  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
  with jax.set_mesh(mesh):
    out, max_logits = run(*args, jax.device_put(ids, NamedSharding(mesh, P(('data', 'fsdp'), None))))
  want = np_each_document(lambda q, k, v: ref_attention(q, k, v, True)[0], ids, q, k, v)
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
  xla = attention_lib.attention(q, k, v, return_max_logits=True, segment_ids=ids)[1]
  np.testing.assert_allclose(max_logits, xla, rtol=1e-5, atol=1e-6)


def test_cudnn_refuses_segments_and_gpu_runs_tokamax_for_them():
  assert not attention_lib.IMPLS['cudnn'].segment_mask
  assert all(attention_lib.IMPLS[name].segment_mask for name in ('xla', 'tokamax', 'gpu'))
  q = jnp.zeros((2, 24, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"impl='cudnn' has no document \(segment\) mask; use impl='tokamax'"):
    attention_lib._cudnn_attention(q, q, q, True, 0.25, False, None, jnp.asarray(SHORT_SEGMENTS))
  assert attention_lib.gpu_choice(q, q, False) == 'cudnn'
  assert attention_lib.gpu_choice(q, q, False, SHORT_SEGMENTS) == 'tokamax'
  with pytest.raises(ValueError, match=r'segment_ids must be \[B, T\] = \[2, 24\]'):
    attention_lib.attention(q, q, q, segment_ids=SHORT_SEGMENTS[:, :5])


# ----------------------------------------------------------------------------- KDA

KDA_IMPLS = impl_params(kda_lib.IMPLS)
KDA_TOL = {'xla': 2e-5, 'xla_recurrent': 1e-5, 'pallas': 1e-4}


def _kda_inputs(seed=0, h=2, dk=16, dv=16):
  rng = np.random.default_rng(seed)
  b, t = KDA_SEGMENTS.shape
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.normal(size=(b, t, h, dk))), unit(rng.normal(size=(b, t, h, dk)))
  v = rng.normal(size=(b, t, h, dv))
  f = rng.normal(size=(b, t, h, dk)) * 2.0  # the gate's pre-activation
  g = rng.uniform(-1.0, 0.0, size=(b, t, h, dk))
  beta = rng.uniform(0.0, 1.0, size=(b, t, h))
  s0 = rng.normal(size=(b, h, dk, dv))
  w_o, w_s = rng.normal(size=v.shape), rng.normal(size=s0.shape)
  gate = (np.log(rng.uniform(1, 16, size=h)), rng.normal(size=(h, dk)) - 2.0)
  f32 = lambda *x: tuple(np.asarray(a, np.float32) for a in x)
  return f32(q, k, v, f, g, beta, s0), f32(w_o, w_s), f32(*gate)


def _each_document_loss(run, w_o, w_s):
  """(q, k, v, g, beta, s0) -> the loss of running each document alone through run(q, k, v, g,
  beta, s0 or None) -> (o, s): sum(o * w_o) over every document, plus sum(s * w_s) of each row's last
  document; the row's first document starts from s0, the others from zero."""
  spans = np_document_spans(KDA_SEGMENTS)

  def loss(q, k, v, g, beta, s0):
    total = 0.0
    for i, (row, a, b) in enumerate(spans):
      cut = lambda x: x[row : row + 1, a:b]
      o, s = run(*(cut(x) for x in (q, k, v, g, beta)), s0[row : row + 1] if a == 0 else None)
      total += jnp.sum(o * cut(w_o))
      if i + 1 == len(spans) or spans[i + 1][0] != row:
        total += jnp.sum(s * w_s[row])
    return total

  return loss


def _kda_each_document(q, k, v, g, beta, s0):
  """The float64 recurrence run document by document: (o [B, T, H, V], each row's final state,
  its last document's); the row's first document starts from s0, the others from zero."""
  o, s = np.zeros(v.shape), np.zeros(s0.shape)
  for row, a, b in np_document_spans(KDA_SEGMENTS):
    o[row : row + 1, a:b], s_doc = ref_kda(
      *(x[row : row + 1, a:b] for x in (q, k, v, g, beta)), 16**-0.5, s0[row : row + 1] if a == 0 else None
    )
    s[row] = s_doc[0]
  return o, s


@functools.cache
def _packed_kda(impl, gated):
  """jit(value_and_grad) of sum(o * w_o) + sum(s * w_s) of kda under impl over the packed rows."""

  def loss(q, k, v, g, beta, s0, w_o, w_s, *gate):
    kw = dict(a_log=gate[0], dt_bias=gate[1]) if gated else {}
    o, s = kda_lib.kda(
      q, k, v, g, beta, impl=impl, initial_state=s0, output_final_state=True, segment_ids=KDA_SEGMENTS, **kw
    )
    return jnp.sum(o * w_o) + jnp.sum(s * w_s), (o, s)

  argnums = tuple(range(6)) + ((8, 9) if gated else ())
  return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


@functools.cache
def _reference(gated):
  """(inputs, o and final state of the float64 recurrence per document, the gradients of jax.grad
  of the recurrence run per document), once per gate choice for every implementation."""
  (q, k, v, f, g, beta, s0), (w_o, w_s), (a_log, dt_bias) = _kda_inputs(seed=int(gated))
  if not gated:
    args = (q, k, v, g, beta, s0)
    run = lambda q, k, v, g, beta, s0: kda_lib.kda_recurrent(
      q, k, v, g, beta, initial_state=s0, output_final_state=True
    )
    grads = jax.jit(jax.grad(_each_document_loss(run, w_o, w_s), argnums=tuple(range(6))))(*args)
    return args + (w_o, w_s), _kda_each_document(q, k, v, g, beta, s0), grads

  def loss(q, k, v, f, beta, s0, a_log, dt_bias):
    def run(q, k, v, f, beta, s0):
      g = -jnp.exp(a_log)[:, None] * jax.nn.softplus(f + dt_bias)
      return kda_lib.kda_recurrent(q, k, v, g, beta, initial_state=s0, output_final_state=True)

    return _each_document_loss(run, w_o, w_s)(q, k, v, f, beta, s0)

  args = (q, k, v, f, beta, s0, a_log, dt_bias)
  grads = jax.jit(jax.grad(loss, argnums=tuple(range(8))))(*args)
  g = np.asarray(kda_lib.kda_log_decay(f, a_log, dt_bias))
  return args[:6] + (w_o, w_s) + args[6:], _kda_each_document(q, k, v, g, beta, s0), grads


@pytest.mark.parametrize('impl', KDA_IMPLS)
def test_kda_on_packed_documents_equals_each_document_alone(impl):
  """Output and final state against the float64 recurrence run per document; the six gradients
  (the initial state's reaching the row's first document only, g's at a document's first token
  zero) against jax.grad of the recurrence run per document."""
  args, (o_ref, s_ref), want = _reference(False)
  (_, (o, s)), grads = _packed_kda(impl, False)(*args)
  assert rel(o, o_ref) < KDA_TOL[impl] and rel(s, s_ref) < KDA_TOL[impl], (rel(o, o_ref), rel(s, s_ref))
  for name, a, b in zip(('q', 'k', 'v', 'g', 'beta', 'initial_state'), grads, want):
    assert np.all(np.isfinite(a)) and rel(a, b) <= KDA_TOL[impl], (name, rel(a, b))
  starts = np.asarray(segments.segment_starts(KDA_SEGMENTS))
  assert np.all(np.asarray(grads[3])[starts] == 0)


@pytest.mark.parametrize('impl', KDA_IMPLS)
def test_kda_gated_on_packed_documents_equals_each_document_alone(impl):
  """The gated call (under 'pallas' the gate and the resets inside the cumulative-sum kernels):
  output, final state and all eight gradients (f, a_log and dt_bias included) against the gate in
  jax.nn and the recurrence run per document."""
  args, (o_ref, s_ref), want = _reference(True)
  (_, (o, s)), grads = _packed_kda(impl, True)(*args)
  assert rel(o, o_ref) < KDA_TOL[impl] and rel(s, s_ref) < KDA_TOL[impl], (rel(o, o_ref), rel(s, s_ref))
  for name, a, b in zip(('q', 'k', 'v', 'f', 'beta', 'initial_state', 'a_log', 'dt_bias'), grads, want):
    # A_log's gradient sums dg g over every token and feature of a head (a sum that cancels much
    # here: 0.21 of terms up to 0.8). After a reset the kernels' chunk-wide cumulative sums sit near
    # RESET_LOG_DECAY = -128, where float32 keeps 1.5e-5 absolute: 1.05e-4 measured (3.3e-5 on the
    # same rows without segments).
    tol = 2e-4 if (impl, name) == ('pallas', 'a_log') else KDA_TOL[impl]
    assert np.all(np.isfinite(a)) and rel(a, b) <= tol, (name, rel(a, b))


def test_kda_pallas_resets_with_the_gate_formed_in_xla():
  """KdaSettings(fused_gate=0): the gate and the resets go into g in XLA before the kernels."""
  from kernels_pallas.kda.settings import KdaSettings

  (q, k, v, f, _, beta, _), _, (a_log, dt_bias) = _kda_inputs(seed=2)
  o, _ = kda_lib.kda(
    q,
    k,
    v,
    f,
    beta,
    impl='pallas',
    a_log=a_log,
    dt_bias=dt_bias,
    segment_ids=KDA_SEGMENTS,
    settings=KdaSettings(fused_gate=0),
  )
  g = np.asarray(kda_lib.kda_log_decay(f, a_log, dt_bias))
  assert rel(o, np_each_document(lambda *x: ref_kda(*x, 16**-0.5)[0], KDA_SEGMENTS, q, k, v, g, beta)) < 1e-4


def test_kda_without_segments_is_unchanged_and_bad_segments_are_an_error():
  """One document per row (segment ids all equal) is the call without segment ids, bit for bit."""
  (q, k, v, _, g, beta, s0), _, _ = _kda_inputs(seed=3)
  one = np.ones(KDA_SEGMENTS.shape, np.int32)
  for impl in ('xla', 'xla_recurrent'):
    run = jax.jit(functools.partial(kda_lib.kda, impl=impl))
    plain = run(q, k, v, g, beta, initial_state=s0)[0]
    np.testing.assert_array_equal(run(q, k, v, g, beta, initial_state=s0, segment_ids=one)[0], plain)
  with pytest.raises(ValueError, match=r'segment_ids must be \[B, T\] = \[2, 128\]; got \[2, 127\]'):
    kda_lib.kda(q, k, v, g, beta, segment_ids=one[:, 1:])


# ----------------------------------------------------------------------------- the short convolution

CONV_IMPLS = impl_params(sc.IMPLS)


@pytest.mark.parametrize('impl', CONV_IMPLS)
def test_short_conv_on_packed_documents_equals_each_document_alone(impl):
  """Forward against the float64 conv per document; the gradients in x and the taps against the
  'xla' form's autodiff run per document (T = 24: one tile of the kernels with a tail)."""
  x, w, dy = short_conv_inputs(0, *SHORT_SEGMENTS.shape, 2, 16)
  y, _ = sc.short_conv(x, w, 'silu_l2', impl=impl, segment_ids=SHORT_SEGMENTS)
  want = np_each_document(lambda x: np_short_conv(x, w, 'silu_l2'), SHORT_SEGMENTS, np.asarray(x))
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)

  def packed(x, w):
    return jnp.sum(sc.short_conv(x, w, 'silu_l2', impl=impl, segment_ids=SHORT_SEGMENTS)[0] * dy)

  def each(x, w):
    parts = [(r, a, b) for r, a, b in np_document_spans(SHORT_SEGMENTS)]
    return sum(jnp.sum(sc.short_conv(x[r : r + 1, a:b], w, 'silu_l2')[0] * dy[r : r + 1, a:b]) for r, a, b in parts)

  for name, got, ref in zip(('dx', 'dw'), jax.grad(packed, (0, 1))(x, w), jax.jit(jax.grad(each, (0, 1)))(x, w)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()), err_msg=name)


def test_short_conv_first_document_reads_the_prefix_and_the_others_do_not():
  """With a prefix (prefill from a cache), the row's first document continues from it; later
  documents start from zeros."""
  x, w, _ = short_conv_inputs(1, 1, 12, 2, 16)
  ids = segment_ids([2, 10])
  prefix = jax.random.normal(jax.random.key(2), (1, 3, 2, 16))
  y, next_prefix = sc.short_conv(x, w, 'none', prefix, segment_ids=ids)
  whole = np_short_conv(np.concatenate([prefix, x], axis=1), w, 'none')[:, 3:]
  np.testing.assert_allclose(y[:, :2], whole[:, :2], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(y[:, 2:], np_short_conv(x[:, 2:], w, 'none'), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(next_prefix, x[:, -3:])


# ----------------------------------------------------------------------------- GPU, compiled


def realistic_segments(b, t, seed=0, low=1024, high=4096):
  """Rows of documents of uniform length in [low, high) (the first and last cut by the row)."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(b):
    lengths = [int(rng.integers(1, high))]  # the tail of a document before the row
    while sum(lengths) < t:
      lengths.append(int(rng.integers(low, high)))
    lengths[-1] -= sum(lengths) - t
    rows.append(lengths)
  return segment_ids(*rows)


@pytest.mark.gpu
def test_gpu_tokamax_and_gpu_on_packed_documents_match_xla():
  """bf16 at (2, 4096, 16, 128), documents of 1-4k tokens: 'tokamax' and 'gpu' against 'xla'."""
  b, t, h, d = 2, 4096, 16, 128
  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, d_out = (jax.random.normal(key, (b, t, h, d), jnp.float32).astype(jnp.bfloat16) for key in keys)
  ids = jnp.asarray(realistic_segments(b, t))
  results = {}
  for impl in ('xla', 'tokamax', 'gpu'):
    run = lambda q, k, v, impl=impl: attention_lib.attention(
      q, k, v, impl=impl, return_max_logits=True, segment_ids=ids
    )
    out, m = jax.jit(run)(q, k, v)
    loss = lambda q, k, v, run=run: jnp.sum(run(q, k, v)[0].astype(jnp.float32) * d_out.astype(jnp.float32))
    results[impl] = (out.astype(jnp.float32), m, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
  out_x, m_x, g_x = results['xla']
  for impl in ('tokamax', 'gpu'):
    out, m, g = results[impl]
    assert rel_rmse(out, out_x) <= 5e-3, impl
    np.testing.assert_allclose(m, m_x, rtol=1e-5, err_msg=impl)
    for name, a, b_ in zip('qkv', g, g_x):
      assert rel_rmse(a.astype(jnp.float32), b_.astype(jnp.float32)) <= 1e-2, (impl, name)


@pytest.mark.gpu
def test_gpu_kda_pallas_on_packed_documents_matches_float32_chunk_form():
  """The gated call in bf16 at (2, 4096, 4, 128) with documents of 1-4k tokens, compiled, against
  the XLA chunk form in float32 on the same packed rows (outputs <= 5e-3, gradients <= 1e-2). The
  gate's gradients (f, A_log, dt_bias) sum bf16 rounding over many tokens: on an H200 at this shape
  they are 1.31e-2, 0.80e-2 and 2.33e-2 with these documents and 1.31e-2, 0.82e-2 and 2.32e-2 for the
  same rows without segment ids, so masking adds no error; they are bounded at 3e-2."""
  b, t, h, d = 2, 4096, 4, 128
  ids = jnp.asarray(realistic_segments(b, t, seed=1))
  rng = np.random.default_rng(0)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  bf = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16)
  q, k = bf(unit(rng.normal(size=(b, t, h, d)))), bf(unit(rng.normal(size=(b, t, h, d))))
  v, f = bf(rng.normal(size=(b, t, h, d))), bf(rng.normal(size=(b, t, h, d)) * 0.5)
  beta = bf(rng.uniform(0, 1, size=(b, t, h)))
  a_log = jnp.asarray(np.log(rng.uniform(1, 16, size=h)), jnp.float32)
  dt_bias = jnp.asarray(rng.normal(size=(h, d)) - 4.5, jnp.float32)
  w_o = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)

  def loss(impl, dtype, *args):
    q, k, v, f, beta, a_log, dt_bias = (x.astype(dtype) if x.ndim > 2 else x for x in args)
    o, _ = kda_lib.kda(q, k, v, f, beta, impl=impl, a_log=a_log, dt_bias=dt_bias, segment_ids=ids)
    return jnp.sum(o.astype(jnp.float32) * w_o), o

  args = (q, k, v, f, beta, a_log, dt_bias)
  (_, o), grads = jax.jit(jax.value_and_grad(functools.partial(loss, 'pallas', jnp.bfloat16), range(7), has_aux=True))(
    *args
  )
  with jax.default_matmul_precision('highest'):
    (_, o_r), grads_r = jax.jit(
      jax.value_and_grad(functools.partial(loss, 'xla', jnp.float32), range(7), has_aux=True)
    )(*args)
  assert rel_rmse(o.astype(jnp.float32), o_r) <= 5e-3
  for name, a, b_ in zip(('q', 'k', 'v', 'f', 'beta', 'a_log', 'dt_bias'), grads, grads_r):
    bound = 3e-2 if name in ('f', 'a_log', 'dt_bias') else 1e-2
    assert rel_rmse(a.astype(jnp.float32), b_.astype(jnp.float32)) <= bound, (name, rel_rmse(a, b_))


@pytest.mark.gpu
def test_gpu_short_conv_pallas_on_packed_documents_matches_float32_plain_form():
  """The hybrid step's shape (16, 4096, 8, 128) in bf16 with documents of 1-4k tokens against the
  plain form in float32 on the same packed rows."""
  x, w, dy = short_conv_inputs(5, 16, 4096, 8, 128, jnp.bfloat16)
  ids = jnp.asarray(realistic_segments(16, 4096, seed=2))
  y = sc.short_conv(x, w, 'silu_l2', impl='pallas', segment_ids=ids)[0]
  y_ref = sc.short_conv(x.astype(jnp.float32), w, 'silu_l2', impl='xla', segment_ids=ids)[0]
  assert rel_rmse(y.astype(jnp.float32), y_ref) <= 5e-3

  def grads(impl, x):
    loss = lambda x, w: jnp.sum(sc.short_conv(x, w, 'silu_l2', impl=impl, segment_ids=ids)[0].astype(jnp.float32) * dy)
    return jax.jit(jax.grad(loss, (0, 1)))(x, w)

  for name, a, b in zip(('dx', 'dw'), grads('pallas', x), grads('xla', x.astype(jnp.float32))):
    assert rel_rmse(a.astype(jnp.float32), b) <= 1e-2, name
