"""Attention Residuals (SPEC §4): the depth-attention op, the model wiring (full and block), its
carried state, sharding and remat, and the optimizer routing of its parameters.

References are written here from SPEC §4 in float64 NumPy: the op's formula with the key gain
applied to the normalised keys (the model folds it into the query), and a whole-model forward
that keeps every sublayer output and forms block sums and partial sums from that list (the model
instead carries a running state). The sublayer maths reuses tests/test_model.py's NumPy helpers.
"""

import json
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_model as tm          # tests/ is on sys.path under pytest
import test_sharding as ts
from kimijax import config as config_lib
from kimijax.layers import residual as residual_lib
from kimijax.model import Transformer
from kimijax.ops.attnres import (depth_attention, depth_attention_list, merge_norm, merge_partial,
                                 phase1)


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  with jax.default_matmul_precision('highest'):
    yield


B, T = tm.B, tm.T


def np_depth_attention(sources, w, gain, eps):
  """float64: alpha_i = softmax_i(w . (gain * v_i / rms(v_i))), h = sum_i alpha_i v_i.
  Returns (h [..., D], alpha [N, ...])."""
  v = np.stack(sources).astype(np.float64)
  keys = gain * v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)
  logits = keys @ w
  alpha = np.exp(logits - logits.max(axis=0))
  alpha /= alpha.sum(axis=0)
  return np.einsum('n...,n...d->...d', alpha, v), alpha


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
  assert tm.rel_err(got, ref) <= 1e-5

  # The list form: same result, and weights that match the reference.
  h, w = depth_attention_list(list(jnp.asarray(sources)), jnp.asarray(query), return_weights=True)
  assert tm.rel_err(h, ref) <= 1e-5
  np.testing.assert_allclose(w, alpha, rtol=1e-5, atol=1e-6)

  # Zero query: the plain mean. One source: that source exactly.
  np.testing.assert_allclose(depth_attention(jnp.asarray(sources), jnp.zeros(d)), sources.mean(0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(depth_attention(jnp.asarray(sources[:1]), jnp.asarray(query)), sources[0])

  # bf16 sources: computed in float32, returned in bf16 (one rounding of the float32 result).
  got16 = depth_attention(jnp.asarray(sources, jnp.bfloat16), jnp.asarray(query))
  ref16, _ = np_depth_attention(list(np.asarray(jnp.asarray(sources, jnp.bfloat16), np.float64)),
                                query.astype(np.float64), 1.0, 1e-6)
  assert got16.dtype == jnp.bfloat16 and tm.rel_err(got16, ref16) <= 2 ** -8


def random_block(n, s, b=B, t=T, d=16, seed=0):
  """n sources of very different scales, a partial sum and S queries, float32 NumPy."""
  rng = np.random.default_rng(seed)
  scales = np.geomspace(1e-2, 30.0, n + 1)
  arrays = [(rng.standard_normal((b, t, d)) * c).astype(np.float32) for c in scales]
  return arrays[:n], arrays[n], (0.5 * rng.standard_normal((s, d))).astype(np.float32)


@pytest.mark.parametrize('impl', ['xla', 'pallas'])
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
    assert tm.rel_err(outs[j], want) <= 1e-5
    v = np.stack(sources).astype(np.float64)
    logits = (v / np.sqrt(np.mean(v * v, -1, keepdims=True) + 1e-6)) @ q
    np.testing.assert_allclose(lse[j], np.log(np.exp(logits).sum(0)), rtol=1e-5, atol=1e-5)
    merged = merge_partial(outs[j], lse[j], jnp.asarray(partial), jnp.asarray(q, jnp.float32))
    want, _ = np_depth_attention(sources + [partial], q, 1.0, 1e-6)
    assert tm.rel_err(merged, want) <= 1e-5


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
    return (sum(jnp.sum(o.astype(jnp.float32) * w) for o, w in zip(outs, w_outs)) + jnp.sum(lse * w_lse)
            + later_use * sum(jnp.sum(v.astype(jnp.float32) * w_src) * (i + 1)
                              for i, v in enumerate(sources)))
  return loss


def test_pallas_phase1_gradients_match_autodiff_of_xla():
  """The Pallas kernels' hand-written backward (interpreted) against jax.grad of the plain-XLA
  phase 1: 5 * 60 = 300 tokens (not a multiple of the kernels' tiles, and three of the grads
  kernel's 128-row programs, whose query-gradient partials are summed) and S = 3."""
  sources, _, queries = random_block(n=4, s=3, b=5, t=60, d=48)
  args = ([jnp.asarray(v) for v in sources], jnp.asarray(queries))
  for later_use in (True, False):     # without a later use the kernel adds no gradient of it
    want = jax.grad(phase1_loss('xla', (5, 60, 48), 3, later_use=later_use), argnums=(0, 1))(*args)
    got = jax.grad(phase1_loss('pallas', (5, 60, 48), 3, later_use=later_use), argnums=(0, 1))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert tm.rel_err(g, np.asarray(w, np.float64)) <= 1e-5
  # eps = 0 stays finite: the 300 tokens are padded to 384 inside, with rows that are not zero.
  from kernels_pallas.attnres import phase1 as kernel
  dq = jax.grad(lambda q: jnp.sum(kernel(args[0], q, eps=0.0, interpret=True)[1]))(args[1])
  assert np.all(np.isfinite(dq))


def test_pallas_phase1_bf16_and_many_queries():
  """bf16 sources give bf16 outputs within one bf16 rounding of the float32 result; more than
  16 queries run in groups of 16, and their gradients too."""
  from kernels_pallas.attnres import MAX_QUERIES
  s = MAX_QUERIES + 2
  sources, _, queries = random_block(n=2, s=s, b=1, t=8, d=32)
  sources16 = [jnp.asarray(v, jnp.bfloat16) for v in sources]
  got, lse, _ = phase1(sources16, jnp.asarray(queries), impl='pallas')
  want, want_lse, _ = phase1(sources16, jnp.asarray(queries), impl='xla')
  assert len(got) == s and all(o.dtype == jnp.bfloat16 for o in got)
  for o, w in zip(got, want):
    assert tm.rel_err(o, np.asarray(w.astype(jnp.float32), np.float64)) <= 2 ** -8
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
  args = ([jnp.asarray(v) for v in sources], jnp.asarray(queries))
  want = jax.grad(phase1_loss('xla', (1, 8, 32), s), argnums=(0, 1))(*args)
  got = jax.grad(phase1_loss('pallas', (1, 8, 32), s), argnums=(0, 1))(*args)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert tm.rel_err(g, np.asarray(w, np.float64)) <= 1e-5
  # bf16 sources (the kernels' bf16 path: one dot per source for dq), gradients against the
  # float32 gradients of the same values: bf16 cotangents and a bf16 result, a few roundings.
  args16 = (sources16, jnp.asarray(queries))
  got16 = jax.grad(phase1_loss('pallas', (1, 8, 32), s), argnums=(0, 1))(*args16)
  want16 = jax.grad(phase1_loss('xla', (1, 8, 32), s), argnums=(0, 1))(
      [v.astype(jnp.float32) for v in sources16], args16[1])
  for g, w in zip(jax.tree.leaves(got16), jax.tree.leaves(want16)):
    assert tm.rel_err(g, np.asarray(w, np.float64)) <= 2 ** -7
  assert all(g.dtype == jnp.bfloat16 for g in got16[0])


def test_kernel_tiles_are_checked():
  """A mistyped tile key is an error naming it, not silently the default; so is a dot's row tile
  under 16; a feature chunk is a power of two whatever the target."""
  from kernels_pallas.attnres import feature_chunk, parse_tiles, phase1 as kernel
  from kernels_pallas.attnres_merge import merge_norm as merge_kernel
  sources, _, queries = random_block(n=2, s=2, b=1, t=8, d=32)
  with pytest.raises(ValueError, match="unknown tile keys \\['bt_grad'\\]"):
    kernel([jnp.asarray(v) for v in sources], jnp.asarray(queries), tiles={'bt_grad': 32}, interpret=True)
  with pytest.raises(ValueError, match='rows_grads and bt_logits .* >= 16; got 8 and 64'):
    kernel([jnp.asarray(v) for v in sources], jnp.asarray(queries), tiles={'rows_grads': 8}, interpret=True)
  with pytest.raises(ValueError, match='bt_grads \\(48\\) must divide rows_grads \\(128\\)'):
    kernel([jnp.asarray(v) for v in sources], jnp.asarray(queries), tiles={'bt_grads': 48}, interpret=True)
  assert feature_chunk(96, 48) == 32 and feature_chunk(1024, 1024) == 1024
  args = random_merge((1, 8, 32))
  with pytest.raises(ValueError, match="unknown tile keys \\['wraps'\\]"):
    merge_kernel(*args, eps=1e-6, norm_eps=1e-6, dtype=jnp.float32, tiles={'wraps': 4}, interpret=True)
  assert parse_tiles('bt=32/warps=8') == {'bt': 32, 'warps': 8}
  with pytest.raises(ValueError, match='key=int'):
    parse_tiles('bt')


@pytest.mark.parametrize('dtype,n,s', [(jnp.bfloat16, 9, 6), (jnp.float32, 1, 16), (jnp.bfloat16, 3, 1)])
def test_pallas_kernels_lower_to_triton_for_an_h200(dtype, n, s):
  """Forward and backward of phase 1 and of merge_norm (with the addend and a later use of the
  partial sum) at the bench model's width, in the dtypes and query counts training uses, lowered
  for an H200 on this machine: the Triton lowering rejects what it cannot express (a shape that is
  not a power of two, an op without a Triton rule) before any GPU time is spent."""
  from experiments.tools.triton_report import attnres_block, lower_for_h200
  fn, args = attnres_block(n, s, 4096, 1024, dtype)
  module = lower_for_h200(fn, *args)
  for name in ('phase1_logits', 'phase1_combine', 'phase1_vdo', 'phase1_grads', 'merge_norm',
               'merge_norm_bwd'):
    assert f'"attnres_{name}"' in module, name


def np_merge_norm(o, lse, partial, q, scale, eps, norm_eps):
  """float64 SPEC §4 phase 2 then RMSNorm: the softmax over [block sums (their logsumexp lse),
  partial] as a two-way gate, the merged input normalised with gain `scale`."""
  o, lse, p = (np.asarray(a, np.float64) for a in (o, lse, partial))
  s_p = (p / np.sqrt(np.mean(p * p, -1, keepdims=True) + eps)) @ q
  sigma = (1 / (1 + np.exp(s_p - lse)))[..., None]
  h = sigma * o + (1 - sigma) * p
  return scale * h / np.sqrt(np.mean(h * h, -1, keepdims=True) + norm_eps)


MERGE_ARGS = ('o', 'lse', 'partial', 'query', 'scale')


def random_merge(shape, seed=5, dtype=jnp.float32):
  """Phase-2 inputs (o, lse, partial, query, scale) with gates spread over (0, 1)."""
  rng = np.random.default_rng(seed)
  o = rng.standard_normal(shape) * 2
  partial = rng.standard_normal(shape) * 0.3
  lse = rng.standard_normal(shape[:-1]) * 2
  q, scale = 0.5 * rng.standard_normal(shape[-1:]), 1 + 0.3 * rng.standard_normal(shape[-1:])
  return (jnp.asarray(o, dtype), jnp.asarray(lse, jnp.float32), jnp.asarray(partial, dtype),
          jnp.asarray(q, jnp.float32), jnp.asarray(scale, jnp.float32))


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
      x, partial = merge_norm(o, lse, partial, q, scale, eps=1e-6, norm_eps=1e-5, addend=y, spec=spec)
    else:
      partial = partial if y is None else partial + y
      x = rms_normalise(merge_partial(o, lse, partial, q, eps=1e-6), 1e-5) * scale
    return jnp.sum(x * w) + (jnp.sum(partial * w_p) if later_use else 0.0)
  return loss


def test_merge_norm_matches_numpy_and_autodiff():
  """Phase 2 fused with the pre-norm (the kernels, interpreted): the output against the float64
  formula, and the hand-written backward (with the partial sum's later gradient added in)
  against jax.grad of the unfused XLA form, at 5 * 60 =
  300 tokens (padded to 320: ten backward programs of 8 tiles of 4 rows) and D = 48 (feature
  chunks of 16). bf16 inputs give a bf16 output within one bf16 rounding, and gradients within
  a few bf16 roundings of the float32 ones."""
  shape = (5, 60, 48)
  args = random_merge(shape)
  want = np_merge_norm(*args, 1e-6, 1e-5)
  got, partial = merge_norm(*args, eps=1e-6, norm_eps=1e-5)
  assert got.dtype == jnp.float32 and tm.rel_err(got, want) <= 1e-5
  np.testing.assert_array_equal(partial, args[2])
  for later_use in (True, False):     # without a later use the kernel adds no gradient of it
    grads = jax.grad(merge_norm_loss(True, shape, later_use=later_use), argnums=tuple(range(5)))(*args)
    wants = jax.grad(merge_norm_loss(False, shape, later_use=later_use), argnums=tuple(range(5)))(*args)
    for name, g, w in zip(MERGE_ARGS, grads, wants):
      assert tm.rel_err(g, np.asarray(w, np.float64)) <= 1e-5, (name, later_use)

  args16 = random_merge(shape, dtype=jnp.bfloat16)
  got16 = merge_norm(*args16, eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16)[0]
  assert got16.dtype == jnp.bfloat16
  assert tm.rel_err(got16, np_merge_norm(*args16, 1e-6, 1e-5)) <= 2 ** -8
  grads16 = jax.grad(merge_norm_loss(True, shape), argnums=tuple(range(5)))(*args16)
  wants16 = jax.grad(merge_norm_loss(False, shape), argnums=tuple(range(5)))(
      *(a.astype(jnp.float32) for a in args16))
  for name, a, g, w in zip(MERGE_ARGS, args16, grads16, wants16):
    assert g.dtype == a.dtype and tm.rel_err(g, np.asarray(w, np.float64)) <= 2 ** -7, name


def test_merge_norm_adds_the_sublayer_output_in_the_kernel():
  """With an addend y, merge_norm forms the partial sum p + y itself: the same normalised input as
  merge_norm of the XLA sum, p + y back (rounded like an XLA add, also in bf16), and gradients of
  p and y both equal to the unfused form's gradient of the sum, with and without a later use."""
  shape = (5, 60, 48)
  args = random_merge(shape)
  y = jnp.asarray(np.random.default_rng(7).standard_normal(shape) * 0.3, jnp.float32)
  want_x, want_p = merge_norm(*args[:2], args[2] + y, *args[3:], eps=1e-6, norm_eps=1e-5)
  got_x, got_p = merge_norm(*args, eps=1e-6, norm_eps=1e-5, addend=y)
  np.testing.assert_array_equal(got_p, want_p)
  assert tm.rel_err(got_x, np.asarray(want_x, np.float64)) <= 1e-6
  for later_use in (True, False):
    grads = jax.grad(merge_norm_loss(True, shape, later_use=later_use, addend=True),
                     argnums=tuple(range(6)))(*args, y)
    wants = jax.grad(merge_norm_loss(False, shape, later_use=later_use, addend=True),
                     argnums=tuple(range(6)))(*args, y)
    for name, g, w in zip(MERGE_ARGS + ('addend',), grads, wants):
      assert tm.rel_err(g, np.asarray(w, np.float64)) <= 1e-5, (name, later_use)
  args16, y16 = random_merge(shape, dtype=jnp.bfloat16), y.astype(jnp.bfloat16)
  got16 = merge_norm(*args16, eps=1e-6, norm_eps=1e-5, dtype=jnp.bfloat16, addend=y16)
  want16 = merge_norm(*args16[:2], args16[2] + y16, *args16[3:], eps=1e-6, norm_eps=1e-5,
                      dtype=jnp.bfloat16)
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
  shard = lambda a: jax.device_put(a, NamedSharding(mesh, P(*spec[:a.ndim])))
  sources, _, queries = random_block(n=3, s=2, b=8, t=4, d=32)
  merge_args = random_merge(shape)
  cases = [(phase1_loss('pallas', shape, 2), phase1_loss('pallas', shape, 2, spec=spec),
            ([jnp.asarray(v) for v in sources], jnp.asarray(queries)), (0, 1)),
           (merge_norm_loss(True, shape), merge_norm_loss(True, shape, spec=spec),
            merge_args, tuple(range(5))),
           (merge_norm_loss(True, shape, addend=True), merge_norm_loss(True, shape, spec=spec, addend=True),
            merge_args + (merge_args[2] * 0.5,), tuple(range(6)))]
  for loss, sharded_loss, args, argnums in cases:
    want = jax.value_and_grad(loss, argnums=argnums)(*args)
    sharded = jax.tree.map(lambda a: shard(a) if a.shape[:2] == shape[:2] else a, args)   # not q
    run = jax.jit(jax.value_and_grad(sharded_loss, argnums=argnums))
    with jax.set_mesh(mesh):
      got = run(*sharded)
      hlo = run.lower(*sharded).as_text()
    # Inside the shard_map (sdy.manual_computation) the [8, 4, 32] inputs are [1, 4, 32] shards.
    body = hlo[hlo.index('sdy.manual_computation'):]
    assert re.search(r'manual_axes=\{"data"\} \(%arg\d+: tensor<1x4x32xf32>', body), \
        'the kernels should run on per-device shards'
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the model


def cfg_for(residual, **overrides):
  return tm.tiny_model_config(residual=residual, **overrides)


def np_attnres_forward(cfg, params, tokens):
  """float64 forward of an AttnRes model: (logits, mean weights per consumer, input RMS, output RMS).

  Every sublayer output is kept; consumer l (sublayer index, or L for the final aggregator) with
  block size S sees b_0 = embedding, the sums of the blocks [kS, (k+1)S) that end at or before l,
  and the sum of the outputs of its own block before l when there are any.
  """
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  tokens = np.asarray(tokens)
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape).astype(np.float64)
  S = 1 if cfg.residual == 'attnres_full' else cfg.attnres_block_size
  emb = p['embed'][tokens]
  outputs, weights, in_rms, out_rms = [], [], [], []

  def consume(l, q):
    n = l // S
    sources = [emb] + [sum(outputs[k * S:(k + 1) * S]) for k in range(n)]
    if l % S:
      sources.append(sum(outputs[n * S:l]))
    if q is None:                 # sublayer 0: the embedding alone, no parameters
      assert l == 0 and len(sources) == 1
      q = {'attnres_query': np.zeros(cfg.d_model), 'attnres_key_scale': np.ones(cfg.d_model)}
    h, alpha = np_depth_attention(sources, q['attnres_query'], q['attnres_key_scale'], cfg.norm_eps)
    weights.append(alpha.mean(axis=(1, 2)))
    in_rms.append(np.sqrt(np.mean(h * h)))
    return h

  for i in range(cfg.num_layers):
    lp = p[f'layer_{i}']
    h = consume(2 * i, p['attnres'].get(f'layer_{i}_mixer'))
    y, _ = tm.np_attention_block(tm.np_rmsnorm(h, lp['mixer_norm']['scale'], cfg.norm_eps),
                                 lp['attention'], positions, cfg)
    outputs.append(y)
    h = consume(2 * i + 1, p['attnres'][f'layer_{i}_mlp'])
    x = tm.np_rmsnorm(h, lp['mlp_norm']['scale'], cfg.norm_eps)
    mlp = lp['mlp']
    outputs.append((tm.np_silu(x @ tm.kernel(mlp['wi_gate'])) * (x @ tm.kernel(mlp['wi_up'])))
                   @ tm.kernel(mlp['wo']))
  out_rms = [np.sqrt(np.mean(y * y)) for y in outputs]
  h = consume(2 * cfg.num_layers, p['attnres']['final'])
  x = tm.np_rmsnorm(h, p['final_norm']['scale'], cfg.norm_eps)
  head = p['embed'].T if cfg.tie_embeddings else p['head']
  return x @ head, weights, np.array(in_rms), np.array(out_rms)


_FORWARDS = {}


def forward(cfg, params, tokens, log=False):
  """Jitted Transformer.apply, compiled once per (config, log)."""
  key = (cfg.to_json(), log)
  if key not in _FORWARDS:
    _FORWARDS[key] = jax.jit(Transformer(cfg, log_attnres=log).apply)
  return _FORWARDS[key]({'params': params}, tokens)


@pytest.mark.parametrize('residual,block,impl,remat', [
    ('attnres_full', 4, 'xla', False), ('attnres_block', 3, 'xla', False),
    ('attnres_block', 2, 'xla', False), ('attnres_block', 3, 'pallas', False),
    ('attnres_block', 2, 'pallas', True), ('attnres_full', 4, 'pallas', False)])
def test_forward_matches_numpy_reference(residual, block, impl, remat):
  """Random non-zero pseudo-queries and key gains (tm.init_params draws every leaf), 2 layers;
  block 3 does not divide the 4 sublayers (last block of 1), block 2 does; phase 1 by XLA or by
  the Pallas kernels (interpreted on the CPU). With 'pallas' phase 2 and the pre-norm run fused
  (merge_norm), the final aggregator's too under block 3 (it is left a partial sum); the
  gradients then equal those of the XLA model, also under remat."""
  cfg = cfg_for(residual, attnres_block_size=block, attnres_impl=impl, remat=remat)
  params = tm.init_params(cfg)
  assert np.abs(params['attnres']['layer_1_mlp']['attnres_query']).min() > 0
  tokens = tm.random_tokens(cfg)
  logits, aux = forward(cfg, params, tokens, log=True)
  ref_logits, ref_w, ref_in, ref_out = np_attnres_forward(cfg, params, tokens)
  assert tm.rel_err(logits, ref_logits) <= 1e-5
  if impl == 'pallas':
    assert tm.rel_err(forward(cfg, params, tokens)[0], ref_logits) <= 1e-5
    # The kernels' backward through the whole model: jax.grad of the same model in plain XLA.
    grads = jax.jit(jax.grad(loss_fn(cfg)))(params)
    want = jax.jit(jax.grad(loss_fn(cfg_for(residual, attnres_block_size=block, remat=remat))))(params)
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want)):
      assert tm.rel_err(g, np.asarray(w, np.float64)) <= 1e-5, jax.tree_util.keystr(path)

  # aux['attnres']: weights padded with NaN to the widest row; RMS per sublayer and consumer.
  st = aux['attnres']
  width = max(len(w) for w in ref_w)
  assert st['weights'].shape == (2 * cfg.num_layers + 1, width)
  for row, ref in zip(np.asarray(st['weights']), ref_w):
    np.testing.assert_allclose(row[:len(ref)], ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.isnan(row[len(ref):]))
  assert max(np.max(np.abs(r - 1 / len(r))) for r in ref_w) > 1e-2, 'weights should not be uniform'
  np.testing.assert_allclose(st['input_rms'], ref_in, rtol=1e-5)
  np.testing.assert_allclose(st['output_rms'], ref_out, rtol=1e-5)
  # Max logits still come out per attention layer.
  assert list(aux['max_logits']) == ['layer_0', 'layer_1']


def copy_shared(std_params, attnres_cfg, seed=7):
  """The AttnRes params tree holding std_params' sublayer weights; pseudo-queries zero (their
  initial value) and key gains random (they must not matter while the queries are zero)."""
  shapes = nn.unbox(jax.eval_shape(Transformer(attnres_cfg).init, jax.random.key(0),
                                   jnp.zeros((1, T), jnp.int32))['params'])
  rng = np.random.default_rng(seed)
  flat_std = {jax.tree_util.keystr(k): v for k, v in jax.tree.leaves_with_path(std_params)}
  leaves, treedef = jax.tree.flatten_with_path(shapes)
  new = []
  for path, leaf in leaves:
    name = jax.tree_util.keystr(path)
    if name.endswith("['attnres_query']"):
      new.append(jnp.zeros(leaf.shape, leaf.dtype))
    elif name.endswith("['attnres_key_scale']"):
      new.append(jnp.asarray(1 + 0.5 * rng.standard_normal(leaf.shape), leaf.dtype))
    else:
      new.append(flat_std.pop(name))
  assert not flat_std, f'standard parameters without a place in the AttnRes tree: {list(flat_std)}'
  return jax.tree.unflatten(treedef, new)


@pytest.mark.parametrize('residual', ['attnres_full', 'attnres_block'])
def test_zero_queries_equal_standard_model(residual):
  """SPEC §4: at zero init every consumer takes the mean of its sources; every consumer
  normalises its input, so the logits equal the standard pre-norm model's (norm eps made
  negligible: the mean of many small sources is small)."""
  std_cfg = cfg_for('standard', norm_eps=1e-12)
  cfg = cfg_for(residual, norm_eps=1e-12, attnres_block_size=3)
  std_params = tm.init_params(std_cfg)
  params = copy_shared(std_params, cfg)
  tokens = tm.random_tokens(cfg)
  ref_logits, ref_aux = forward(std_cfg, std_params, tokens)
  logits, aux = forward(cfg, params, tokens)
  assert tm.rel_err(logits, np.asarray(ref_logits, np.float64)) <= 1e-5
  for name, m in ref_aux['max_logits'].items():
    np.testing.assert_allclose(aux['max_logits'][name], m, rtol=1e-5)
  # ...and only because the queries are zero: one non-zero pseudo-query changes the logits.
  moved = jax.tree.map(lambda x: x, params)
  moved['attnres']['layer_1_mlp']['attnres_query'] = jnp.full((cfg.d_model,), 0.3)
  assert tm.rel_err(forward(cfg, moved, tokens)[0], np.asarray(ref_logits, np.float64)) > 1e-3


def loss_fn(cfg):
  tokens = tm.random_tokens(cfg, b=2, t=12)
  return lambda p: tm.cross_entropy(Transformer(cfg).apply({'params': p}, tokens)[0], tokens)


def attnres_leaves(tree, suffix):
  return {jax.tree_util.keystr(k): v for k, v in jax.tree.leaves_with_path(tree)
          if jax.tree_util.keystr(k).endswith(f"['{suffix}']")}


def test_block_size_one_is_full_and_gradients_reach_every_query():
  full, block1 = cfg_for('attnres_full'), cfg_for('attnres_block', attnres_block_size=1)
  params = tm.init_params(full)                      # non-zero pseudo-queries
  tokens = tm.random_tokens(full)
  np.testing.assert_allclose(forward(block1, params, tokens)[0], forward(full, params, tokens)[0],
                             rtol=1e-6, atol=1e-6)

  # From the real initial state (queries 0): every pseudo-query gets a non-zero gradient.
  init = nn.unbox(Transformer(full).init(jax.random.key(0), tokens)['params'])
  queries = attnres_leaves(init, 'attnres_query')
  # The first sublayer sees the embedding alone and has no query; every other consumer has one.
  assert len(queries) == 2 * full.num_layers and all(np.all(q == 0) for q in queries.values())
  grads = jax.jit(jax.grad(loss_fn(full)))(init)
  for name, g in attnres_leaves(grads, 'attnres_query').items():
    assert np.max(np.abs(g)) > 0, name
  # From a non-uniform state the key gains get gradients too (at zero queries theirs is 0).
  grads = jax.jit(jax.grad(loss_fn(full)))(params)
  for suffix in ('attnres_query', 'attnres_key_scale'):
    for name, g in attnres_leaves(grads, suffix).items():
      assert np.max(np.abs(g)) > 0, name


# ----------------------------------------------------------------------------- carried state


def sources_after(sublayers_done: int, s: int) -> int:
  """Sources of the block state after `sublayers_done` sublayers: b_0, completed blocks, partial."""
  return 1 + sublayers_done // s + (sublayers_done % s != 0)


def expected_carry(sublayers_done: int, s: int, num_sublayers: int) -> int:
  """[B, T, D] arrays in the block state after `sublayers_done` sublayers: the sources and,
  inside a block after its first read, the block's phase-1 outputs (one per consumer of the
  block: S, fewer in the last block). Block 0's first read is sublayer 1's (sublayer 0 sees the
  embedding alone), and its phase-1 outputs are the embedding itself (one source)."""
  sources = sources_after(sublayers_done, s)
  start = sublayers_done - sublayers_done % s
  in_block = sublayers_done % s != 0 and sublayers_done > 1
  return sources + (min(s, num_sublayers + 1 - start) if in_block else 0)


def test_block_state_holds_n_plus_one_sources():
  """Traced model with remat: each layer's checkpointed call takes the residual state as its
  carry; count its [B, T, D] inputs (no parameter has that shape) and outputs. Block AttnRes
  carries at most N + 1 sources and the current block's S phase-1 outputs: O(N + S), not O(L)."""
  layers, s = 4, 3                        # L = 8 sublayers, N = ceil(8 / 3) = 3 blocks
  counts = {}
  for residual in ('attnres_block', 'attnres_full', 'standard'):
    cfg = cfg_for(residual, num_layers=layers, attnres_block_size=s, remat=True)
    tokens = jnp.zeros((B, T), jnp.int32)
    params = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), tokens)['params'])
    jaxpr = jax.make_jaxpr(lambda p: Transformer(cfg).apply({'params': p}, tokens))(params)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ('remat2', 'checkpoint', 'remat')]
    assert len(calls) == layers, [e.primitive.name for e in jaxpr.jaxpr.eqns]
    btd = lambda vs: sum(v.aval.shape == (B, T, cfg.d_model) for v in vs)
    counts[residual] = [btd(e.invars) for e in calls] + [btd(calls[-1].outvars)]
  # Block: sources 1, 2, 3, 3, 4 (at most N + 1 = 4, not L + 1 = 9); blocks 0, 1 and 2 were
  # entered by layers 0, 1 and 3 (sublayers 1, 3 and 6), so layer 1's and 2's inputs and the
  # output carry 3 phase-1 outputs (in block 0: the embedding, three times).
  assert counts['attnres_block'] == [expected_carry(2 * i, s, 8) for i in range(layers + 1)] \
      == [1, 2 + 3, 3 + 3, 3, 4 + 3]
  assert residual_lib.num_sources(cfg_for('attnres_block', num_layers=layers, attnres_block_size=s)) == 4
  # Full: every read is its own block, closed by the next write: sources only.
  assert counts['attnres_full'] == [expected_carry(2 * i, 1, 8) for i in range(layers + 1)] == [1, 3, 5, 7, 9]
  assert counts['standard'] == [1] * (layers + 1)


# ----------------------------------------------------------------------------- sharding, remat


def sharded_config(shape, remat=False):
  c = ts.make_config('mha', shape)
  c.model.residual, c.model.attnres_block_size, c.model.remat = 'attnres_block', 3, remat
  return config_lib.validate(c)


def test_sharded_and_remat_training_match_one_device():
  """3 real train steps (AdamW moves the zero pseudo-queries at step 1, so steps 2-3 run with
  non-uniform depth weights) on fsdp and data x fsdp x tensor meshes, and with remat, give the
  one-device losses and gradient norms."""
  assert len(jax.devices()) == 8
  ref, ref_state, _, _ = ts.train(sharded_config((1, 1, 1)), jax.devices()[:1])
  ref_losses = [float(h['loss']) for h in ref]
  assert len(set(ref_losses)) == ts.STEPS
  q = attnres_leaves(jax.tree.map(np.asarray, ref_state.params), 'attnres_query')
  assert all(np.max(np.abs(v)) > 0 for v in q.values())
  for shape, remat in (((1, 8, 1), False), ((2, 2, 2), True)):
    history, state, _, _ = ts.train(sharded_config(shape, remat), jax.devices())
    np.testing.assert_allclose([float(h['loss']) for h in history], ref_losses, rtol=ts.RTOL, atol=0,
                               err_msg=str((shape, remat)))
    np.testing.assert_allclose([float(h['grad_norm']) for h in history],
                               [float(h['grad_norm']) for h in ref], rtol=ts.RTOL, atol=0)
    for name, leaf in attnres_leaves(state.params, 'attnres_query').items():   # replicated
      assert all(s.data.shape == leaf.shape for s in leaf.addressable_shards), name


# ----------------------------------------------------------------------------- parameters


def test_attnres_parameters_are_vectors_routed_to_adamw():
  """Pseudo-queries and key gains are 1-D [D] with logical axis 'norm' (replicated), and Muon's
  default routing (kimijax.optim.routing) sends them to AdamW while the sublayer matrices of the
  same model still go to Muon (SPEC §2)."""
  from kimijax.optim.routing import ADAMW, MUON, Routing
  cfg = cfg_for('attnres_block', attnres_block_size=3)
  boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))['params']
  specs = nn.get_partition_spec(boxed)
  params = nn.unbox(boxed)
  for suffix in ('attnres_query', 'attnres_key_scale'):
    leaves = attnres_leaves(params, suffix)
    assert len(leaves) == 2 * cfg.num_layers          # all consumers but sublayer 0
    assert "['attnres']['layer_0_mixer']" not in ''.join(leaves)
    assert all(v.shape == (cfg.d_model,) for v in leaves.values())
    assert all(tuple(s) == ('norm',) for s in attnres_leaves(specs, suffix).values())
  extra = sum(v.size for k, v in jax.tree.leaves_with_path(params)
              if 'attnres' in jax.tree_util.keystr(k))
  assert extra == 2 * cfg.d_model * 2 * cfg.num_layers     # SPEC: 2d per consumer

  routes = Routing().routes(boxed)
  for suffix in ('attnres_query', 'attnres_key_scale'):
    assert all(r.rule == ADAMW for r in attnres_leaves(routes, suffix).values())
  for suffix in ('query', 'out', 'wi_gate', 'wo'):
    rules = {r.rule for r in attnres_leaves(routes, suffix).values()}
    assert rules == {MUON}, (suffix, rules)


@pytest.mark.parametrize('key,value', [('residual', 'attnres'), ('attnres_block_size', 0),
                                       ('attnres_block_size', -2), ('attnres_impl', 'triton'),
                                       ('attnres_impl', 'pallas')])
def test_config_rejects_bad_values(key, value):
  c = config_lib.base_config()
  c.model.d_model = 40                    # the Pallas kernels need d_model divisible by 16
  c.model.residual = 'attnres_block'
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError, match=f'model.{key}'):
    config_lib.validate(c)


# ----------------------------------------------------------------------------- logging and figures


def test_training_logs_depth_statistics_and_plot_script_draws_them(tmp_path):
  """train.log_attnres: metrics.jsonl carries one weight row per consumer (only the sources it
  sees, summing to 1) and the RMS lists; experiments/plot_attnres.py reads the checkpoint back
  and writes both figures."""
  from configs.default import get_config
  from experiments import plot_attnres
  from kimijax.train.loop import train
  from kimijax.train.metrics import read_metrics

  c = get_config()
  c.model.update(dict(d_model=32, num_layers=2, num_heads=2, mlp_dim=64, residual='attnres_block',
                      attnres_block_size=3))
  c.train.update(dict(seq_len=32, batch_size=2, steps=2, log_every=1, eval_every=2, eval_batches=1,
                      checkpoint_every=2, plot=False, log_attnres=True))
  train(c, tmp_path, devices=jax.devices()[:1])
  records = [r for r in read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in records] == [1, 2]
  widths = [sources_after(l, 3) for l in range(5)]            # sources of consumers 0..3, final
  for r in records:
    assert [len(row) for row in r['attnres_weights']] == widths == [1, 2, 2, 2, 3]
    assert all(abs(sum(row) - 1) < 1e-5 for row in r['attnres_weights'])
    assert len(r['attnres_input_rms']) == 5 and len(r['attnres_output_rms']) == 4
    assert all(x > 0 for x in r['attnres_output_rms'])

  stats = plot_attnres.collect_stats(tmp_path, batches=1)
  assert stats['step'] == 2 and stats['weights'].shape == (5, 3)
  paths = plot_attnres.plot({'run': stats}, tmp_path / 'figures')
  assert sorted(p.name for p in paths) == ['attnres_rms.png', 'attnres_stats.json', 'attnres_weights_run.png']
  assert all(p.stat().st_size > 5000 for p in paths if p.suffix == '.png')
  saved = json.loads((tmp_path / 'figures' / 'attnres_stats.json').read_text())['run']
  assert saved['weights'][0] == [1.0, None, None]             # NaN padding saved as null
