"""Attention Residuals' ops (docs/attention_residuals.md; kimijax.ops.attnres): depth attention, and Block AttnRes in
two phases (phase 1 over a block's fixed sources, phase 2 merged with the consumer's pre-norm),
every implementation in IMPLS against float64 NumPy (tests/oracles.py) and the Pallas kernels'
hand-written backward (interpreted on the CPU) against jax.grad of the XLA form, also per shard on a mesh;
then the ablated variants (no key norm, sigmoid weights; 'xla' only) against the same oracle.

The oracle applies the key gain to the normalised keys; the model folds it into the query.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import B, T, impl_params, random_block, random_merge, rel_err
from oracles import np_depth_attention, np_merge_norm, np_rmsnorm

from kimijax.ops import attnres as attnres_ops
from kimijax.ops.attnres import depth_attention, depth_attention_list, merge_norm, merge_partial, phase1

IMPLS = impl_params(attnres_ops.IMPLS)


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  with jax.default_matmul_precision('highest'):
    yield


# ----------------------------------------------------------------------------- the op


def test_depth_attention_matches_numpy():
  rng = np.random.default_rng(0)
  n, d = 5, 16
  # Sources of very different scales: the RMS-normalised keys make the logits scale-free.
  scales = np.array([1e-2, 1.0, 30.0, 0.3, 3.0])[:, None, None, None]
  sources = (rng.standard_normal((n, B, T, d)) * scales).astype(np.float32)
  query = (0.5 * rng.standard_normal(d)).astype(np.float32)
  ref, alpha = np_depth_attention(list(sources), query.astype(np.float64), 1.0, 1e-6)
  assert alpha.min() < 0.05 and alpha.max() > 0.5, 'weights should be far from uniform'

  got = jax.jit(depth_attention)(jnp.asarray(sources), jnp.asarray(query))
  assert got.shape == (B, T, d) and got.dtype == jnp.float32
  assert rel_err(got, ref) <= 1e-5

  # The list form: same result, and weights that match the reference.
  h, w = depth_attention_list(list(jnp.asarray(sources)), jnp.asarray(query), return_weights=True)
  assert rel_err(h, ref) <= 1e-5
  np.testing.assert_allclose(w, alpha, rtol=1e-5, atol=1e-6)

  # Zero query: the plain mean. One source: that source exactly.
  np.testing.assert_allclose(depth_attention(jnp.asarray(sources), jnp.zeros(d)), sources.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(depth_attention(jnp.asarray(sources[:1]), jnp.asarray(query)), sources[0])

  # bf16 sources: computed in float32, returned in bf16 (one rounding of the float32 result).
  got16 = depth_attention(jnp.asarray(sources, jnp.bfloat16), jnp.asarray(query))
  ref16, _ = np_depth_attention(
    list(np.asarray(jnp.asarray(sources, jnp.bfloat16), np.float64)), query.astype(np.float64), 1.0, 1e-6
  )
  assert got16.dtype == jnp.bfloat16 and rel_err(got16, ref16) <= 2**-8


@pytest.mark.parametrize('impl', IMPLS)
def test_two_phases_equal_one_softmax_over_all_sources(impl):
  """Phase 1 over the block sums, merged with each consumer's partial sum, is the float64 depth
  attention over [block sums, partial] for every query (impl 'pallas' runs interpreted here);
  lse is the logsumexp of the block-sum logits."""
  sources, partial, queries = random_block(n=3, s=4)
  outs, lse, passed = phase1([jnp.asarray(v) for v in sources], jnp.asarray(queries), impl=impl)
  for v, p in zip(sources, passed):
    np.testing.assert_array_equal(p, v)
  assert len(outs) == 4 and lse.shape == (4, B, T)
  for j, q in enumerate(queries.astype(np.float64)):
    want, _ = np_depth_attention(sources, q, 1.0, 1e-6)
    assert rel_err(outs[j], want) <= 1e-5
    v = np.stack(sources).astype(np.float64)
    logits = (v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6)) @ q
    np.testing.assert_allclose(lse[j], np.log(np.exp(logits).sum(0)), rtol=1e-5, atol=1e-5)
    merged = merge_partial(outs[j], lse[j], jnp.asarray(partial), jnp.asarray(q, jnp.float32))
    want, _ = np_depth_attention(sources + [partial], q, 1.0, 1e-6)
    assert rel_err(merged, want) <= 1e-5


def phase1_loss(impl, shape, s, seed=3, spec=None, later_use=True):
  """A random projection of phase 1's outputs and lse, and (later_use) of the sources as passed
  through (as the model's later blocks use them, so the kernels add that gradient in): a scalar
  whose gradient reaches all inputs."""
  rng = np.random.default_rng(seed)
  w_outs = jnp.asarray(rng.standard_normal((s,) + shape), jnp.float32)
  w_lse = jnp.asarray(rng.standard_normal((s,) + shape[:-1]), jnp.float32)
  w_src = jnp.asarray(rng.standard_normal(shape), jnp.float32)

  def loss(sources, queries):
    outs, lse, sources = phase1(sources, queries, impl=impl, spec=spec)
    return (
      sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, w_outs))
      + jnp.sum(lse * w_lse)
      + later_use * sum(jnp.sum(v.astype(jnp.float32) * w_src) * (i + 1) for i, v in enumerate(sources))
    )

  return loss


def test_pallas_phase1_gradients_match_autodiff_of_xla():
  """The Pallas kernels' hand-written backward (interpreted) against jax.grad of the plain-XLA
  phase 1: 5 * 60 = 300 tokens (not a multiple of the kernels' tiles, and three of the grads
  kernel's 128-row programs, whose query-gradient partials are summed) and S = 3."""
  sources, _, queries = random_block(n=4, s=3, b=5, t=60, d=48)
  args = ([jnp.asarray(v) for v in sources], jnp.asarray(queries))
  for later_use in (True, False):  # without a later use the kernel adds no gradient of it
    want = jax.grad(phase1_loss('xla', (5, 60, 48), 3, later_use=later_use), argnums=(0, 1))(*args)
    got = jax.grad(phase1_loss('pallas', (5, 60, 48), 3, later_use=later_use), argnums=(0, 1))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert rel_err(g, np.asarray(w, np.float64)) <= 1e-5
  # eps = 0 stays finite: the 300 tokens are padded to 384 inside, with rows that are not zero.
  from kernels_pallas.attnres.phase1 import phase1 as kernel

  dq = jax.grad(lambda q: jnp.sum(kernel(args[0], q, eps=0.0, interpret=True)[1]))(args[1])
  assert np.all(np.isfinite(dq))


@pytest.mark.long
def test_pallas_phase1_bf16_and_many_queries():
  """bf16 sources give bf16 outputs within one bf16 rounding of the float32 result; more than
  16 queries run in groups of 16, and their gradients too."""
  from kernels_pallas.attnres.phase1 import MAX_QUERIES

  s = MAX_QUERIES + 2
  sources, _, queries = random_block(n=2, s=s, b=1, t=8, d=32)
  sources16 = [jnp.asarray(v, jnp.bfloat16) for v in sources]
  got, lse, _ = phase1(sources16, jnp.asarray(queries), impl='pallas')
  want, want_lse, _ = phase1(sources16, jnp.asarray(queries), impl='xla')
  assert len(got) == s and all(o.dtype == jnp.bfloat16 for o in got)
  for o, w in zip(got, want):
    assert rel_err(o, np.asarray(w.astype(jnp.float32), np.float64)) <= 2**-8
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  args = ([jnp.asarray(v) for v in sources], jnp.asarray(queries))
  want = jax.grad(phase1_loss('xla', (1, 8, 32), s), argnums=(0, 1))(*args)
  got = jax.grad(phase1_loss('pallas', (1, 8, 32), s), argnums=(0, 1))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert rel_err(g, np.asarray(w, np.float64)) <= 1e-5
  # bf16 sources (the kernels' bf16 path: one dot per source for dq), gradients against the
  # float32 gradients of the same values: bf16 cotangents and a bf16 result, a few roundings.
  args16 = (sources16, jnp.asarray(queries))
  got16 = jax.grad(phase1_loss('pallas', (1, 8, 32), s), argnums=(0, 1))(*args16)
  want16 = jax.grad(phase1_loss('xla', (1, 8, 32), s), argnums=(0, 1))(
    [v.astype(jnp.float32) for v in sources16], args16[1]
  )
  for g, w in zip(jax.tree.leaves(got16), jax.tree.leaves(want16)):
    assert rel_err(g, np.asarray(w, np.float64)) <= 2**-7
  assert all(g.dtype == jnp.bfloat16 for g in got16[0])


MERGE_ARGS = ('o', 'lse', 'partial', 'query', 'scale')


def merge_norm_loss(fused, shape, spec=None, seed=6, later_use=True, addend=False):
  """Random projections of the normalised input and (later_use) of the partial sum's later use:
  by merge_norm (the kernels; the partial sum taken from its output, so that its gradient is
  added in the backward kernel) or, unfused, by merge_partial and the model's RMSNorm formula.
  addend: a sixth argument y, added to the partial sum first (in the kernel when fused)."""
  from kimijax.layers.norms import rms_normalise

  rng = np.random.default_rng(seed)
  w, w_p = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))

  def loss(o, lse, partial, q, scale, y=None):
    if fused:
      x, partial = merge_norm(o, lse, partial, q, scale, eps=1e-6, norm_eps=1e-5, addend=y, impl='pallas', spec=spec)
    else:
      partial = partial if y is None else partial + y
      x = rms_normalise(merge_partial(o, lse, partial, q, eps=1e-6), 1e-5) * scale
    return jnp.sum(x * w) + (jnp.sum(partial * w_p) if later_use else 0.0)

  return loss


@pytest.mark.parametrize('impl', IMPLS)
def test_merge_norm_matches_numpy(impl):
  """Phase 2 and the pre-norm in one call ('pallas': fused kernels, interpreted) against the
  float64 formula at 5 * 60 = 300 tokens (the kernels pad them to 320) and D = 48 (their feature
  chunks of 16): the partial sum comes back as it went in; with an addend y, the input is formed
  from p + y and p + y comes back (rounded like an XLA add); bf16 inputs or a bf16 output give one
  bf16 rounding of the float32 result."""
  shape = (5, 60, 48)
  args = random_merge(shape)
  want = np_merge_norm(*args, 1e-6, 1e-5)
  got, partial = merge_norm(*args, eps=1e-6, norm_eps=1e-5, impl=impl)
  assert got.dtype == jnp.float32 and rel_err(got, want) <= 1e-5
  np.testing.assert_array_equal(partial, args[2])
  y = jnp.asarray(np.random.default_rng(8).standard_normal(shape) * 0.3, jnp.float32)
  got, partial = merge_norm(*args, eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16, addend=y, impl=impl)
  want = np_merge_norm(*args[:2], np.asarray(args[2]) + np.asarray(y), *args[3:], 1e-6, 1e-5)
  assert got.dtype == jnp.bfloat16 and rel_err(got, want) <= 2**-8
  np.testing.assert_array_equal(partial, args[2] + y)
  args16 = random_merge(shape, dtype=jnp.bfloat16)
  got16 = merge_norm(*args16, eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16, impl=impl)[0]
  assert got16.dtype == jnp.bfloat16
  assert rel_err(got16, np_merge_norm(*args16, 1e-6, 1e-5)) <= 2**-8


def test_pallas_merge_norm_gradients_match_autodiff_of_xla():
  """The fused kernels' hand-written backward (interpreted; with the partial sum's later gradient
  added in) against jax.grad of the unfused XLA form, at 300 tokens (padded to 320: ten backward
  programs of 8 tiles of 4 rows) and D = 48; bf16 gradients within a few bf16 roundings of the
  float32 ones."""
  shape = (5, 60, 48)
  args = random_merge(shape)
  for later_use in (True, False):  # without a later use the kernel adds no gradient of it
    grads = jax.grad(merge_norm_loss(True, shape, later_use=later_use), argnums=tuple(range(5)))(*args)
    wants = jax.grad(merge_norm_loss(False, shape, later_use=later_use), argnums=tuple(range(5)))(*args)
    for name, g, w in zip(MERGE_ARGS, grads, wants):
      assert rel_err(g, np.asarray(w, np.float64)) <= 1e-5, (name, later_use)

  args16 = random_merge(shape, dtype=jnp.bfloat16)
  grads16 = jax.grad(merge_norm_loss(True, shape), argnums=tuple(range(5)))(*args16)
  wants16 = jax.grad(merge_norm_loss(False, shape), argnums=tuple(range(5)))(*(a.astype(jnp.float32) for a in args16))
  for name, a, g, w in zip(MERGE_ARGS, args16, grads16, wants16):
    assert g.dtype == a.dtype and rel_err(g, np.asarray(w, np.float64)) <= 2**-7, name


def test_an_unknown_impl_is_one_error_naming_the_allowed_ones():
  args = random_merge((2, 5, 16))
  with pytest.raises(ValueError, match=r"attnres merge_norm: impl must be one of \('xla', 'pallas'\); got 'triton'"):
    merge_norm(*args, impl='triton')


def test_merge_norm_adds_the_sublayer_output_in_the_kernel():
  """With an addend y, merge_norm forms the partial sum p + y itself: the same normalised input as
  merge_norm of the XLA sum, p + y back (rounded like an XLA add, also in bf16), and gradients of
  p and y both equal to the unfused form's gradient of the sum, with and without a later use."""
  shape = (5, 60, 48)
  args = random_merge(shape)
  y = jnp.asarray(np.random.default_rng(7).standard_normal(shape) * 0.3, jnp.float32)
  want_x, want_p = merge_norm(*args[:2], args[2] + y, *args[3:], eps=1e-6, norm_eps=1e-5, impl='pallas')
  got_x, got_p = merge_norm(*args, eps=1e-6, norm_eps=1e-5, addend=y, impl='pallas')
  np.testing.assert_array_equal(got_p, want_p)
  assert rel_err(got_x, np.asarray(want_x, np.float64)) <= 1e-6
  for later_use in (True, False):
    grads = jax.grad(merge_norm_loss(True, shape, later_use=later_use, addend=True), argnums=tuple(range(6)))(*args, y)
    wants = jax.grad(merge_norm_loss(False, shape, later_use=later_use, addend=True), argnums=tuple(range(6)))(*args, y)
    for name, g, w in zip(MERGE_ARGS + ('addend',), grads, wants):
      assert rel_err(g, np.asarray(w, np.float64)) <= 1e-5, (name, later_use)
  args16, y16 = random_merge(shape, dtype=jnp.bfloat16), y.astype(jnp.bfloat16)
  got16 = merge_norm(*args16, eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16, addend=y16, impl='pallas')
  want16 = merge_norm(
    *args16[:2], args16[2] + y16, *args16[3:], eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16, impl='pallas'
  )
  for g, w in zip(got16, want16):
    np.testing.assert_array_equal(g, w)


def test_pallas_kernels_under_a_mesh_run_per_shard():
  """8 devices, tokens sharded over the batch: the shard_map path (each device runs the kernels
  on its 1 of 8 batch rows) gives the one-device outputs and gradients, for phase 1 and for the
  fused phase 2, with and without an addend (the gradients of the replicated queries and gain
  summed over shards)."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  mesh = jax.make_mesh((8,), ('data',), axis_types=(jax.sharding.AxisType.Auto,))
  shape, spec = (8, 4, 32), P('data', None, None)
  shard = lambda a: jax.device_put(a, NamedSharding(mesh, P(*spec[: a.ndim])))
  sources, _, queries = random_block(n=3, s=2, b=8, t=4, d=32)
  merge_args = random_merge(shape)
  cases = [
    (
      phase1_loss('pallas', shape, 2),
      phase1_loss('pallas', shape, 2, spec=spec),
      ([jnp.asarray(v) for v in sources], jnp.asarray(queries)),
      (0, 1),
    ),
    (merge_norm_loss(True, shape), merge_norm_loss(True, shape, spec=spec), merge_args, tuple(range(5))),
    (
      merge_norm_loss(True, shape, addend=True),
      merge_norm_loss(True, shape, spec=spec, addend=True),
      merge_args + (merge_args[2] * 0.5,),
      tuple(range(6)),
    ),
  ]
  for loss, sharded_loss, args, argnums in cases:
    want = jax.value_and_grad(loss, argnums=argnums)(*args)
    sharded = jax.tree.map(lambda a: shard(a) if a.shape[:2] == shape[:2] else a, args)  # not q
    run = jax.jit(jax.value_and_grad(sharded_loss, argnums=argnums))
    with jax.set_mesh(mesh):
      got = run(*sharded)
      hlo = run.lower(*sharded).as_text()
    # Inside the shard_map (sdy.manual_computation) the [8, 4, 32] inputs are [1, 4, 32] shards.
    body = hlo[hlo.index('sdy.manual_computation') :]
    assert re.search(r'manual_axes=\{"data"\} \(%arg\d+: tensor<1x4x32xf32>', body), (
      'the kernels should run on per-device shards'
    )
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the ablated variants


VARIANTS = [(False, 'softmax'), (True, 'sigmoid'), (False, 'sigmoid')]  # (key_norm, depth_weights)
VARIANT_IDS = ['no_key_norm', 'sigmoid', 'no_key_norm+sigmoid']


def variant_sources(n=5, d=16, seed=0):
  """Sources of different scales (moderate: raw keys without the norm would saturate on 30x
  ones) and a query, float32 NumPy."""
  rng = np.random.default_rng(seed)
  scales = np.array([0.1, 1.0, 3.0, 0.3, 2.0])[:n, None, None, None]
  return (
    (rng.standard_normal((n, B, T, d)) * scales).astype(np.float32),
    (0.3 * rng.standard_normal(d)).astype(np.float32),
  )


@pytest.mark.parametrize('key_norm,depth_weights', VARIANTS, ids=VARIANT_IDS)
def test_depth_attention_variants_match_numpy(key_norm, depth_weights):
  """docs/attention_residuals.md's ablated switches against the float64 transcription: both forms, the weights, the
  zero query (softmax: the mean; sigmoid: half the sum), bf16 sources, and the query gradient
  against central differences of the float64 oracle (finite, and the op's own autodiff)."""
  sources, query = variant_sources()
  variant = dict(key_norm=key_norm, depth_weights=depth_weights)
  gain = 1.0 if key_norm else None
  ref, alpha = np_depth_attention(list(sources), query, gain, 1e-6, **variant)
  assert alpha.min() < 0.05 and alpha.max() > 0.7, 'weights should be far from uniform'
  default, _ = np_depth_attention(list(sources), query, 1.0, 1e-6)
  assert rel_err(ref, default) > 1e-2, 'the variant should change the result'

  got = jax.jit(lambda v, q: depth_attention(v, q, **variant))(jnp.asarray(sources), jnp.asarray(query))
  assert got.shape == (B, T, 16) and got.dtype == jnp.float32 and rel_err(got, ref) <= 1e-5
  h, w = depth_attention_list(list(jnp.asarray(sources)), jnp.asarray(query), return_weights=True, **variant)
  assert rel_err(h, ref) <= 1e-5
  np.testing.assert_allclose(w, alpha, rtol=1e-5, atol=1e-6)

  zero = depth_attention(jnp.asarray(sources), jnp.zeros(16), **variant)
  want = sources.mean(0) if depth_weights == 'softmax' else 0.5 * sources.sum(0)
  np.testing.assert_allclose(zero, want, rtol=1e-5, atol=1e-6)

  got16 = depth_attention(jnp.asarray(sources, jnp.bfloat16), jnp.asarray(query), **variant)
  ref16, _ = np_depth_attention(
    list(np.asarray(jnp.asarray(sources, jnp.bfloat16), np.float64)), query, gain, 1e-6, **variant
  )
  assert got16.dtype == jnp.bfloat16 and rel_err(got16, ref16) <= 2**-8

  proj = np.random.default_rng(9).standard_normal((B, T, 16))
  dq = jax.grad(lambda q: jnp.sum(depth_attention(jnp.asarray(sources), q, **variant) * proj))(jnp.asarray(query))
  step, want_dq = 1e-6, np.zeros(16)
  for k in range(16):
    e = np.eye(16)[k] * step
    plus = np_depth_attention(list(sources), query + e, gain, 1e-6, **variant)[0]
    minus = np_depth_attention(list(sources), query - e, gain, 1e-6, **variant)[0]
    want_dq[k] = np.sum((plus - minus) * proj) / (2 * step)
  assert np.all(np.isfinite(dq)) and rel_err(dq, want_dq) <= 1e-4


@pytest.mark.parametrize('n', [1, 3])
@pytest.mark.parametrize('key_norm,depth_weights', VARIANTS, ids=VARIANT_IDS)
def test_two_phases_equal_one_attention_in_every_variant(key_norm, depth_weights, n):
  """impl='xla': phase 1 over n block sums (n = 1: block 0, the embedding alone), then phase 2
  with each consumer's partial sum, is the float64 variant's depth attention over [block sums,
  partial]; merge_norm is that input RMS-normalised with the gain. Sources, gradients finite."""
  sources, _ = variant_sources(n=n + 1, seed=n)
  sources, partial = list(sources[:n]), sources[n]
  queries = (0.3 * np.random.default_rng(4).standard_normal((3, 16))).astype(np.float32)
  variant = dict(key_norm=key_norm, depth_weights=depth_weights)
  gain = 1.0 if key_norm else None
  scale = (1 + 0.3 * np.random.default_rng(5).standard_normal(16)).astype(np.float32)
  outs, lse, _ = phase1([jnp.asarray(v) for v in sources], jnp.asarray(queries), **variant)
  assert len(outs) == 3 and lse.shape == (3, B, T)
  for j, q in enumerate(queries):
    want, _ = np_depth_attention(sources, q, gain, 1e-6, **variant)
    assert rel_err(outs[j], want) <= 1e-5
    merged = merge_partial(outs[j], lse[j], jnp.asarray(partial), jnp.asarray(q), **variant)
    want, _ = np_depth_attention(sources + [partial], q, gain, 1e-6, **variant)
    assert rel_err(merged, want) <= 1e-5
    x, p = merge_norm(
      outs[j],
      lse[j],
      jnp.asarray(partial),
      jnp.asarray(q),
      jnp.asarray(scale),
      eps=1e-6,
      norm_eps=1e-5,
      impl='xla',
      **variant,
    )
    np.testing.assert_array_equal(p, partial)
    assert rel_err(x, np_rmsnorm(want, scale, 1e-5)) <= 1e-5

  def loss(vs, p, qs):
    outs, lse, _ = phase1(vs, qs, **variant)
    return sum(
      jnp.sum(merge_norm(o, l, p, q, jnp.asarray(scale), impl='xla', **variant)[0] * (j + 1))
      for j, (o, l, q) in enumerate(zip(outs, lse, qs))
    )

  grads = jax.grad(loss, argnums=(0, 1, 2))(
    [jnp.asarray(v) for v in sources], jnp.asarray(partial), jnp.asarray(queries)
  )
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert np.max(np.abs(grads[2])) > 0


def test_variant_errors_name_the_argument_and_the_pallas_kernels_refuse_them():
  """The fused kernels implement docs/attention_residuals.md's default alone: another variant with impl='pallas' is
  one ValueError saying to use 'xla', before any kernel runs; bad values name the allowed ones."""
  sources, _, queries = random_block(n=2, s=2)
  vs, qs = [jnp.asarray(v) for v in sources], jnp.asarray(queries)
  o, lse, partial, q, scale = random_merge((B, T, 16))
  for variant in (dict(key_norm=False), dict(depth_weights='sigmoid')):
    with pytest.raises(
      ValueError,
      match=r"attnres phase1: impl='pallas' implements only key_norm=True, "
      r"depth_weights='softmax'.*use impl='xla'",
    ):
      phase1(vs, qs, impl='pallas', **variant)
    with pytest.raises(ValueError, match=r"attnres merge_norm: impl='pallas' implements only"):
      merge_norm(o, lse, partial, q, scale, impl='pallas', **variant)
  with pytest.raises(ValueError, match=r"depth_weights must be one of \('softmax', 'sigmoid'\); got 'tanh'"):
    depth_attention(jnp.stack(vs), qs[0], depth_weights='tanh')
  with pytest.raises(ValueError, match=r'attnres phase1: key_norm must be True or False; got 1'):
    phase1(vs, qs, key_norm=1)
  with pytest.raises(ValueError, match=r'attnres merge_partial: depth_weights must be one of'):
    merge_partial(o, lse, partial, q, depth_weights='relu')
