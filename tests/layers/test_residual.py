"""Attention Residuals in the model (docs/attention_residuals.md; kimijax/layers/residual.py): full and block
strategies against a float64 whole-model forward (tests/oracles.py, which keeps every sublayer
output and forms block sums and partial sums from that list, where the model carries a running
state), the zero-query start, the carried state, sharding and remat, the optimizer routing of
the parameters, config checks and the logged statistics.
"""

import json
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
  RTOL,
  STEPS,
  B,
  T,
  cross_entropy,
  init_params,
  random_tokens,
  rel_err,
  sharding_config,
  tiny_model_config,
  train_steps,
)
from oracles import np_attnres_forward

from kimijax import config as config_lib
from kimijax.layers import residual as residual_lib
from kimijax.layers.norms import RMSNorm
from kimijax.model import Transformer


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  with jax.default_matmul_precision('highest'):
    yield


# ----------------------------------------------------------------------------- the model


def cfg_for(residual, **overrides):
  return tiny_model_config(residual=residual, **overrides)


_FORWARDS = {}


def forward(cfg, params, tokens, log=False):
  """Jitted Transformer.apply, compiled once per (config, log)."""
  key = (cfg.to_json(), log)
  if key not in _FORWARDS:
    _FORWARDS[key] = jax.jit(Transformer(cfg, log_attnres=log).apply)
  return _FORWARDS[key]({'params': params}, tokens)


@pytest.mark.parametrize(
  'residual,block,impl,remat',
  [
    ('attnres_full', 4, 'xla', False),
    ('attnres_block', 3, 'xla', False),
    ('attnres_block', 2, 'xla', False),
    ('attnres_block', 3, 'pallas', False),
    ('attnres_block', 2, 'pallas', True),
    pytest.param('attnres_full', 4, 'pallas', False, marks=pytest.mark.long),
  ],
)  # ~50 s
def test_forward_matches_numpy_reference(residual, block, impl, remat):
  """Random non-zero pseudo-queries and key gains (init_params draws every leaf), 2 layers;
  block 3 does not divide the 4 sublayers (last block of 1), block 2 does; phase 1 by XLA or by
  the Pallas kernels (interpreted on the CPU). With 'pallas' phase 2 and the pre-norm run fused
  (merge_norm), the final aggregator's too under block 3 (it is left a partial sum); the
  gradients then equal those of the XLA model, also under remat."""
  cfg = cfg_for(residual, attnres_block_size=block, attnres_impl=impl, remat=remat)
  params = init_params(cfg)
  assert np.abs(params['attnres']['layer_1_mlp']['attnres_query']).min() > 0
  tokens = random_tokens(cfg)
  logits, aux = forward(cfg, params, tokens, log=True)
  ref_logits, ref_w, ref_in, ref_out = np_attnres_forward(cfg, params, tokens)
  assert rel_err(logits, ref_logits) <= 1e-5
  if impl == 'pallas':
    assert rel_err(forward(cfg, params, tokens)[0], ref_logits) <= 1e-5
    # The kernels' backward through the whole model: jax.grad of the same model in plain XLA.
    grads = jax.jit(jax.grad(loss_fn(cfg)))(params)
    want = jax.jit(jax.grad(loss_fn(cfg_for(residual, attnres_block_size=block, remat=remat))))(params)
    for (path, g), w in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(want)):
      assert rel_err(g, np.asarray(w, np.float64)) <= 1e-5, jax.tree_util.keystr(path)

  # aux['attnres']: weights padded with NaN to the widest row; RMS per sublayer and consumer.
  st = aux['attnres']
  width = max(len(w) for w in ref_w)
  assert st['weights'].shape == (2 * cfg.num_layers + 1, width)
  for row, ref in zip(np.asarray(st['weights']), ref_w):
    np.testing.assert_allclose(row[: len(ref)], ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.isnan(row[len(ref) :]))
  assert max(np.max(np.abs(r - 1 / len(r))) for r in ref_w) > 1e-2, 'weights should not be uniform'
  np.testing.assert_allclose(st['input_rms'], ref_in, rtol=1e-5)
  np.testing.assert_allclose(st['output_rms'], ref_out, rtol=1e-5)
  # Max logits still come out per attention layer.
  assert list(aux['max_logits']) == ['layer_0', 'layer_1']


def copy_shared(std_params, attnres_cfg, seed=7):
  """The AttnRes params tree holding std_params' sublayer weights; pseudo-queries zero (their
  initial value) and key gains random (they must not matter while the queries are zero)."""
  shapes = nn.unbox(
    jax.eval_shape(Transformer(attnres_cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))['params']
  )
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
  """docs/attention_residuals.md: at zero init every consumer takes the mean of its sources; every consumer
  normalises its input, so the logits equal the standard pre-norm model's (norm eps made
  negligible: the mean of many small sources is small)."""
  std_cfg = cfg_for('standard', norm_eps=1e-12)
  cfg = cfg_for(residual, norm_eps=1e-12, attnres_block_size=3)
  std_params = init_params(std_cfg)
  params = copy_shared(std_params, cfg)
  tokens = random_tokens(cfg)
  ref_logits, ref_aux = forward(std_cfg, std_params, tokens)
  logits, aux = forward(cfg, params, tokens)
  assert rel_err(logits, np.asarray(ref_logits, np.float64)) <= 1e-5
  for name, m in ref_aux['max_logits'].items():
    np.testing.assert_allclose(aux['max_logits'][name], m, rtol=1e-5)
  # ...and only because the queries are zero: one non-zero pseudo-query changes the logits.
  moved = jax.tree.map(lambda x: x, params)
  moved['attnres']['layer_1_mlp']['attnres_query'] = jnp.full((cfg.d_model,), 0.3)
  assert rel_err(forward(cfg, moved, tokens)[0], np.asarray(ref_logits, np.float64)) > 1e-3


def loss_fn(cfg):
  tokens = random_tokens(cfg, b=2, t=12)
  return lambda p: cross_entropy(Transformer(cfg).apply({'params': p}, tokens)[0], tokens)


def attnres_leaves(tree, suffix):
  return {
    jax.tree_util.keystr(k): v
    for k, v in jax.tree.leaves_with_path(tree)
    if jax.tree_util.keystr(k).endswith(f"['{suffix}']")
  }


@pytest.mark.long
def test_block_size_one_is_full_and_gradients_reach_every_query():
  full, block1 = cfg_for('attnres_full'), cfg_for('attnres_block', attnres_block_size=1)
  params = init_params(full)  # non-zero pseudo-queries
  tokens = random_tokens(full)
  np.testing.assert_allclose(forward(block1, params, tokens)[0], forward(full, params, tokens)[0], rtol=1e-6, atol=1e-6)

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
  layers, s = 4, 3  # L = 8 sublayers, N = ceil(8 / 3) = 3 blocks
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
  assert (
    counts['attnres_block'] == [expected_carry(2 * i, s, 8) for i in range(layers + 1)] == [1, 2 + 3, 3 + 3, 3, 4 + 3]
  )
  assert residual_lib.num_sources(cfg_for('attnres_block', num_layers=layers, attnres_block_size=s)) == 4
  # Full: every read is its own block, closed by the next write: sources only.
  assert counts['attnres_full'] == [expected_carry(2 * i, 1, 8) for i in range(layers + 1)] == [1, 3, 5, 7, 9]
  assert counts['standard'] == [1] * (layers + 1)


# ----------------------------------------------------------------------------- sharding, remat


def sharded_config(shape, remat=False):
  c = sharding_config('mha', shape)
  c.model.residual, c.model.attnres_block_size, c.model.remat = 'attnres_block', 3, remat
  return config_lib.validate(c)


@pytest.mark.long
def test_sharded_and_remat_training_match_one_device():
  """3 real train steps (AdamW moves the zero pseudo-queries at step 1, so steps 2-3 run with
  non-uniform depth weights) on fsdp and data x fsdp x tensor meshes, and with remat, give the
  one-device losses and gradient norms."""
  assert len(jax.devices()) == 8
  ref, ref_state, _, _ = train_steps(sharded_config((1, 1, 1)), jax.devices()[:1])
  ref_losses = [float(h['loss']) for h in ref]
  assert len(set(ref_losses)) == STEPS
  q = attnres_leaves(jax.tree.map(np.asarray, ref_state.params), 'attnres_query')
  assert all(np.max(np.abs(v)) > 0 for v in q.values())
  for shape, remat in (((1, 8, 1), False), ((2, 2, 2), True)):
    history, state, _, _ = train_steps(sharded_config(shape, remat), jax.devices())
    np.testing.assert_allclose(
      [float(h['loss']) for h in history], ref_losses, rtol=RTOL, atol=0, err_msg=str((shape, remat))
    )
    np.testing.assert_allclose(
      [float(h['grad_norm']) for h in history], [float(h['grad_norm']) for h in ref], rtol=RTOL, atol=0
    )
    for name, leaf in attnres_leaves(state.params, 'attnres_query').items():  # replicated
      assert all(s.data.shape == leaf.shape for s in leaf.addressable_shards), name


# ----------------------------------------------------------------------------- parameters


def test_attnres_parameters_are_vectors_routed_to_adamw():
  """Pseudo-queries and key gains are 1-D [D] with logical axis 'norm' (replicated), and Muon's
  default routing (kimijax.optim.routing) sends them to AdamW while the sublayer matrices of the
  same model still go to Muon (docs/optimizers.md#muon)."""
  from kimijax.optim.routing import ADAMW, MUON, Routing

  cfg = cfg_for('attnres_block', attnres_block_size=3)
  boxed = jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, T), jnp.int32))['params']
  specs = nn.get_partition_spec(boxed)
  params = nn.unbox(boxed)
  for suffix in ('attnres_query', 'attnres_key_scale'):
    leaves = attnres_leaves(params, suffix)
    assert len(leaves) == 2 * cfg.num_layers  # all consumers but sublayer 0
    assert "['attnres']['layer_0_mixer']" not in ''.join(leaves)
    assert all(v.shape == (cfg.d_model,) for v in leaves.values())
    assert all(tuple(s) == ('norm',) for s in attnres_leaves(specs, suffix).values())
  extra = sum(v.size for k, v in jax.tree.leaves_with_path(params) if 'attnres' in jax.tree_util.keystr(k))
  assert extra == 2 * cfg.d_model * 2 * cfg.num_layers  # docs/attention_residuals.md: 2d per consumer

  routes = Routing().routes(boxed)
  for suffix in ('attnres_query', 'attnres_key_scale'):
    assert all(r.rule == ADAMW for r in attnres_leaves(routes, suffix).values())
  for suffix in ('query', 'out', 'wi_gate', 'wo'):
    rules = {r.rule for r in attnres_leaves(routes, suffix).values()}
    assert rules == {MUON}, (suffix, rules)


@pytest.mark.parametrize(
  'key,value',
  [
    ('residual', 'attnres'),
    ('attnres_block_size', 0),
    ('attnres_block_size', -2),
    ('attnres_impl', 'triton'),
    ('attnres_impl', 'pallas'),
  ],
)
def test_config_rejects_bad_values(key, value):
  c = config_lib.base_config()
  c.model.d_model = 40  # the Pallas kernels need d_model divisible by 16
  c.model.residual = 'attnres_block'
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError, match=f'model.{key}'):
    config_lib.validate(c)


# ----------------------------------------------------------------------------- logging and figures


def test_training_logs_depth_statistics_and_plot_script_draws_them(tmp_path):
  """train.log_attnres: metrics.jsonl carries one weight row per consumer (only the sources it
  sees, summing to 1) and the RMS lists; experiments/tools/plot_attnres.py reads the checkpoint back
  and writes both figures."""
  from configs.default import get_config
  from experiments.tools import plot_attnres
  from kimijax.train.loop import train
  from kimijax.train.metrics import read_metrics

  c = get_config()
  c.model.update(
    dict(d_model=32, num_layers=2, num_heads=2, mlp_dim=64, residual='attnres_block', attnres_block_size=3)
  )
  c.train.update(
    dict(
      seq_len=32,
      batch_size=2,
      steps=2,
      log_every=1,
      eval_every=2,
      eval_batches=1,
      checkpoint_every=2,
      plot=False,
      log_attnres=True,
    )
  )
  train(c, tmp_path, devices=jax.devices()[:1])
  records = [r for r in read_metrics(tmp_path) if 'loss' in r]
  assert [r['step'] for r in records] == [1, 2]
  widths = [sources_after(l, 3) for l in range(5)]  # sources of consumers 0..3, final
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
  assert saved['weights'][0] == [1.0, None, None]  # NaN padding saved as null


# ----------------------------------------------------------------------------- the ablated variants
# docs/attention_residuals.md's "no key RMSNorm" and "sigmoid" arms (model.attnres_key_norm,
# model.attnres_depth_weights;
# kimijax.ops.attnres has the maths), XLA only.


def variant_cfg(residual, block, key_norm, depth_weights, **overrides):
  return cfg_for(
    residual, attnres_block_size=block, attnres_key_norm=key_norm, attnres_depth_weights=depth_weights, **overrides
  )


VARIANTS = [
  ('attnres_full', 1, False, 'softmax'),
  ('attnres_full', 1, True, 'sigmoid'),
  ('attnres_block', 3, False, 'softmax'),
  ('attnres_block', 3, True, 'sigmoid'),
  ('attnres_block', 2, False, 'sigmoid'),
]


@pytest.mark.parametrize('residual,block,key_norm,depth_weights', VARIANTS)
def test_variant_forward_matches_numpy_reference(residual, block, key_norm, depth_weights):
  """Each variant's whole-model forward against the float64 oracle (random non-zero queries and,
  with the key norm, gains): logits, the logged depth weights and input RMS. Without the key norm
  no consumer has a key gain (d parameters each). The variant changes the logits: the default
  model on the same parameters (unit gains added where missing) gives others."""
  cfg = variant_cfg(residual, block, key_norm, depth_weights)
  params = init_params(cfg)
  assert len(attnres_leaves(params, 'attnres_key_scale')) == (2 * cfg.num_layers if key_norm else 0)
  assert len(attnres_leaves(params, 'attnres_query')) == 2 * cfg.num_layers
  tokens = random_tokens(cfg)
  logits, aux = forward(cfg, params, tokens, log=True)
  ref_logits, ref_w, ref_in, ref_out = np_attnres_forward(cfg, params, tokens)
  assert rel_err(logits, ref_logits) <= 1e-5
  st = aux['attnres']
  for row, ref in zip(np.asarray(st['weights']), ref_w):
    np.testing.assert_allclose(row[: len(ref)], ref, rtol=1e-5, atol=1e-6)
    assert np.all(np.isnan(row[len(ref) :]))
  np.testing.assert_allclose(st['input_rms'], ref_in, rtol=1e-5)
  np.testing.assert_allclose(st['output_rms'], ref_out, rtol=1e-5)

  with_gains = jax.tree.map(lambda x: x, params)
  for consumer in with_gains['attnres'].values():
    consumer.setdefault('attnres_key_scale', jnp.ones((cfg.d_model,), jnp.float32))
  default_logits = np_attnres_forward(cfg_for(residual, attnres_block_size=block), with_gains, tokens)[0]
  assert rel_err(ref_logits, default_logits) > 1e-3


@pytest.mark.parametrize('residual,block,key_norm,depth_weights', [VARIANTS[0], VARIANTS[3], VARIANTS[4]])
def test_zero_queries_equal_standard_model_in_every_variant(residual, block, key_norm, depth_weights):
  """At zero queries softmax (either key) takes the mean of the sources and sigmoid half their
  sum; every consumer normalises its input, so each variant also starts as the standard model."""
  std_cfg = cfg_for('standard', norm_eps=1e-12)
  cfg = variant_cfg(residual, block, key_norm, depth_weights, norm_eps=1e-12)
  std_params = init_params(std_cfg)
  tokens = random_tokens(cfg)
  ref_logits = forward(std_cfg, std_params, tokens)[0]
  logits = forward(cfg, copy_shared(std_params, cfg), tokens)[0]
  assert rel_err(logits, np.asarray(ref_logits, np.float64)) <= 1e-5


class SublayerStack(nn.Module):
  """A residual strategy driven as the model drives it (start, read, write, the final read), over
  small tanh(Dense) sublayers: the strategy's own graph, cheap to differentiate."""

  res: Any

  @nn.compact
  def __call__(self, x_btd):
    state = self.res.start(x_btd)
    for l in range(self.res.num_sublayers):
      x, _, _, state = self.res.read(state, l, RMSNorm(1e-6, name=f'norm_{l}'))
      state = self.res.write(state, jnp.tanh(nn.Dense(x.shape[-1], name=f'f_{l}')(x)), l)
    return self.res.read(state, self.res.num_sublayers, RMSNorm(1e-6, name='final_norm'))[0]


@pytest.mark.parametrize('block', [1, 2])
@pytest.mark.parametrize('key_norm,depth_weights', [(False, 'softmax'), (True, 'sigmoid'), (False, 'sigmoid')])
def test_variant_gradients_are_finite_and_reach_every_query(block, key_norm, depth_weights):
  """Full (S = 1) and block (S = 2 over 3 sublayers: the one-source phase 1 of block 0, a merge,
  a last block of 1 left as a partial sum for the final aggregator) AttnRes in each variant: from
  the initial state (queries 0) and from random queries every gradient is finite and every
  pseudo-query's is non-zero."""
  res = residual_lib.AttnResidual(block, 3, key_norm=key_norm, depth_weights=depth_weights)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, 16)), jnp.float32)
  target = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, 16)), jnp.float32)
  model = SublayerStack(res)
  params = nn.unbox(jax.jit(model.init)(jax.random.key(0), x)['params'])
  loss = jax.jit(jax.grad(lambda p: jnp.sum(model.apply({'params': p}, x) * target)))
  moved = jax.tree.map(lambda a: a, params)
  rng = np.random.default_rng(4)
  for consumer in moved['attnres'].values():
    consumer['attnres_query'] = jnp.asarray(0.5 * rng.standard_normal(16), jnp.float32)
  for p in (params, moved):
    grads = loss(p)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    queries = attnres_leaves(grads, 'attnres_query')
    assert len(queries) == 3 and len(attnres_leaves(grads, 'attnres_key_scale')) == 3 * key_norm
    for name, g in queries.items():
      assert np.max(np.abs(g)) > 0, name


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('attnres_key_norm', None, r'model.attnres_key_norm=None is not allowed; allowed values: \[True, False\]'),
    (
      'attnres_depth_weights',
      'tanh',
      r"model.attnres_depth_weights='tanh' is not allowed; allowed values: \['softmax', 'sigmoid'\]",
    ),
  ],
)
def test_config_rejects_bad_variant_values(key, value, message):
  c = config_lib.base_config()
  c.model.residual = 'attnres_full'
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError, match=message):
    config_lib.validate(c)


def test_config_says_the_variants_need_the_xla_path():
  """The fused Pallas kernels implement docs/attention_residuals.md's default alone: another variant with
  attnres_impl='pallas' is one ConfigError naming the switch and asking for 'xla'; with 'xla'
  both switches (alone or together) validate, for full and block AttnRes."""
  for residual in ('attnres_full', 'attnres_block'):
    for key_norm, depth_weights in ((False, 'softmax'), (True, 'sigmoid'), (False, 'sigmoid')):
      c = config_lib.base_config()
      c.model.update(dict(residual=residual, attnres_key_norm=key_norm, attnres_depth_weights=depth_weights))
      config_lib.validate(c)
      c.model.attnres_impl = 'pallas'
      switch = 'model.attnres_key_norm=False' if not key_norm else "model.attnres_depth_weights='sigmoid'"
      with pytest.raises(
        config_lib.ConfigError,
        match=f"{re.escape(switch)}.* model.attnres_impl='xla': model.attnres_impl='pallas' implements only",
      ):
        config_lib.validate(c)
