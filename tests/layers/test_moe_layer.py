"""The MoE layer against the float64 NumPy transcription of the released routing (tests/
oracles_moe.py): outputs and the gradient of every parameter; one expert with top-1 is the dense
SwiGLU; sharded over data x expert and fsdp x expert meshes of the 8 fake CPU devices it equals
one device; the train step's helpers (aux loss, bias update, metrics)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from oracles_moe import np_moe_layer, np_route

from kimijax.layers.mlp import SwiGLU
from kimijax.layers.moe import MOE_STATE, MOE_STATS, MoE, moe_aux_loss, moe_metrics, update_moe_state
from kimijax.ops import moe as moe_ops

B, T, D, F = 2, 8, 16, 8

CASES = {
  # DeepSeek-V3's routing at small scale: groups, selection bias, renormalised and scaled
  # weights, shared experts and the sequence-wise balance loss.
  'sigmoid_groups_shared': dict(
    num_experts=8,
    top_k=3,
    n_group=4,
    topk_group=2,
    num_shared=2,
    score_func='sigmoid',
    renormalize=True,
    scaling_factor=2.446,
    aux_loss_alpha=0.05,
  ),
  'softmax_plain': dict(
    num_experts=6,
    top_k=2,
    num_shared=0,
    score_func='softmax',
    renormalize=False,
    scaling_factor=1.0,
    aux_loss_alpha=0.0,
  ),
}


def _oracle_cfg(kw):
  return dict(
    top_k=kw['top_k'],
    score_func=kw['score_func'],
    n_group=kw.get('n_group', 1),
    topk_group=kw.get('topk_group', 1),
    renormalize=kw['renormalize'],
    scaling=kw['scaling_factor'],
    alpha=kw['aux_loss_alpha'],
  )


def random_variables(layer, x, seed, std=0.3):
  """The layer's variables with N(0, std) params and zero biases, drawn here: only the structure
  comes from the layer (eval_shape; compiling its init would cost seconds on the CPU)."""
  shapes = nn.unbox(jax.eval_shape(layer.init, jax.random.key(0), x))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: jnp.asarray(std * rng.standard_normal(s.shape), jnp.float32), shapes['params'])
  return {'params': params, MOE_STATE: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[MOE_STATE])}


def _setup(kw, seed=0, b=B, t=T, impl='xla', remat=False):
  layer = MoE(expert_hidden=F, impl=impl, remat=remat, **kw)
  rng = np.random.default_rng(seed + 100)
  x = jnp.asarray(rng.standard_normal((b, t, D)), jnp.float32)
  params = random_variables(layer, x, seed)['params']
  # A bias of the size of the score gaps, so that it changes which experts are chosen.
  bias = jnp.asarray(0.2 * rng.standard_normal(kw['num_experts']), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((b, t, D)), jnp.float32)
  return layer, params, {'bias': bias}, x, dy


def _loss(layer, params, moe_state, x, dy):
  y, mut = layer.apply({'params': params, MOE_STATE: moe_state}, x, mutable=[MOE_STATS])
  return jnp.sum(y * dy) + moe_aux_loss(mut[MOE_STATS]), (y, mut[MOE_STATS])


def assert_close(got, want, tol, what=''):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
  assert err <= tol, f'{what}: relative max error {err:.3g} > {tol}'


@pytest.mark.parametrize('impl', ['xla', 'xla_blocked'])
@pytest.mark.parametrize('kw', CASES.values(), ids=CASES.keys())
def test_layer_matches_float64_oracle(kw, impl):
  layer, params, moe_state, x, dy = _setup(kw, impl=impl)
  (loss, (y, stats)), (g_params, g_x) = jax.jit(
    jax.value_and_grad(lambda p, x: _loss(layer, p, moe_state, x, dy), argnums=(0, 1), has_aux=True)
  )(params, x)
  ref_y, ref_aux, (experts, weights, _, margin), ref_g = np_moe_layer(
    np.asarray(x), jax.tree.map(np.asarray, params), np.asarray(moe_state['bias']), _oracle_cfg(kw), np.asarray(dy)
  )
  assert margin > 1e-4, f'near-tie in the routing ({margin:.2g}): pick another seed'
  # The bias must change some token's choice, or the test would not see where it acts.
  plain, *_ = np_route(
    np.asarray(x).reshape(B * T, D) @ np.asarray(params['router'], np.float64),
    None,
    top_k=kw['top_k'],
    score_func=kw['score_func'],
    n_group=kw.get('n_group', 1),
    topk_group=kw.get('topk_group', 1),
  )
  assert np.any(np.sort(plain, -1) != np.sort(experts, -1)), 'the bias should change some choice'
  assert_close(y, ref_y, 2e-6, 'y')
  assert_close(stats['aux_loss'], ref_aux, 1e-5, 'aux_loss')
  load = np.bincount(experts.reshape(-1), minlength=kw['num_experts'])
  np.testing.assert_array_equal(stats['load'], load)
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_g))
  for path, g in jax.tree_util.tree_leaves_with_path(g_params):
    assert_close(g, flat_ref[path], 1e-5, jax.tree_util.keystr(path))
  assert_close(g_x, ref_g['x'], 1e-5, 'x')
  assert set(flat_ref) == {p for p, _ in jax.tree_util.tree_leaves_with_path(g_params)} | {
    (jax.tree_util.DictKey('x'),)
  }


def test_remat_experts_keep_only_their_inputs_and_match_the_oracle():
  """remat=True (model.moe.remat): the output and every gradient as the float64 oracle's, and
  what the backward keeps of the layer holds no array of the routed rows (without remat: gate|up
  in the padded slots only)."""
  kw = CASES['sigmoid_groups_shared']
  layer, params, moe_state, x, dy = _setup(kw, impl='xla_blocked', remat=True)
  loss = lambda p, x: _loss(layer, p, moe_state, x, dy)
  (_, (y, _)), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  ref_y, _, _, ref_g = np_moe_layer(
    np.asarray(x), jax.tree.map(np.asarray, params), np.asarray(moe_state['bias']), _oracle_cfg(kw), np.asarray(dy)
  )
  assert_close(y, ref_y, 2e-6, 'y')
  flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_g))
  for path, g in jax.tree_util.tree_leaves_with_path(g_params):
    assert_close(g, flat_ref[path], 1e-5, jax.tree_util.keystr(path))
  assert_close(g_x, ref_g['x'], 1e-5, 'x')

  # The residuals the backward reads (the leaves of the vjp function): without remat the routed
  # experts keep gate|up in the padded slots, [blocks, b, 2F] with blocks * b >= T * K, and no
  # D-wide array of the rows; with remat nothing of the rows at all.
  rows = B * T * kw['top_k']
  b = moe_ops._block_rows(rows, kw['num_experts'], None)
  slots_gate_up = (-(-rows // b) + kw['num_experts'], b, 2 * F)
  for remat in (False, True):
    layer = MoE(expert_hidden=F, impl='xla_blocked', remat=remat, **kw)
    _, backward = jax.vjp(lambda p, x, layer=layer: _loss(layer, p, moe_state, x, dy)[0], params, x)
    shapes = [leaf.shape for leaf in jax.tree.leaves(backward)]
    assert shapes.count(slots_gate_up) == (0 if remat else 1), (remat, shapes)
    assert (B * T, kw['top_k'], D) not in shapes and not any(rows in s for s in shapes), (remat, shapes)


def test_blocked_layer_gradient_scatters_nothing():
  """With 'xla_blocked' the layer's gradient (router, routing, experts, shared experts) is gathers,
  matmuls and elementwise work: its one scatter is sort_by_expert's inverse permutation in the
  forward, a set of unique indices, and nothing scatter-adds (atomics on the GPU). The statistics
  (mutable MOE_STATS) are left out: their loads are bincounts of the choices, with no gradient."""
  layer, params, moe_state, x, dy = _setup(CASES['sigmoid_groups_shared'], impl='xla_blocked')
  loss = lambda p, x: jnp.sum(layer.apply({'params': p, MOE_STATE: moe_state}, x) * dy)
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(params, x).as_text()
  scatters = [line for line in text.splitlines() if '"stablehlo.scatter"(' in line]
  assert len(scatters) == 1 and 'unique_indices = true' in scatters[0], scatters


def test_bias_chooses_but_does_not_weigh():
  """A huge bias on one expert makes every token choose it; its weight is still its unbiased score."""
  kw = dict(CASES['sigmoid_groups_shared'], num_shared=0, aux_loss_alpha=0.0)
  layer, params, _, x, _ = _setup(kw)
  bias = jnp.zeros((8,)).at[5].set(100.0)
  y, mut = jax.jit(lambda v, x: layer.apply(v, x, mutable=[MOE_STATS]))(
    {'params': params, MOE_STATE: {'bias': bias}}, x
  )
  assert float(mut[MOE_STATS]['load'][5]) == B * T
  ref_y, *_ = np_moe_layer(np.asarray(x), jax.tree.map(np.asarray, params), np.asarray(bias), _oracle_cfg(kw))
  assert_close(y, ref_y, 2e-6, 'y')


def test_one_expert_top1_is_the_dense_swiglu():
  layer = MoE(num_experts=1, top_k=1, expert_hidden=F, num_shared=0, scaling_factor=1.0)
  x = jax.random.normal(jax.random.key(3), (B, T, D))
  variables = random_variables(layer, x, seed=4)
  p = variables['params']
  dense = SwiGLU(hidden=F, init_std=0.02)
  dense_params = {'wi_gate': p['wi_gate'][0], 'wi_up': p['wi_up'][0], 'wo': p['wo'][0]}
  want = jax.jit(dense.apply)({'params': dense_params}, x)
  got = jax.jit(layer.apply)({'params': p, MOE_STATE: variables[MOE_STATE]}, x)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(want))))


def test_apply_without_the_bias_fails():
  layer, params, _, x, _ = _setup(CASES['softmax_plain'])
  with pytest.raises(Exception, match='moe_state|bias'):
    layer.apply({'params': params}, x)


# ----------------------------------------------------------------------------- sharded == one device

RULES = (
  ('act_batch', ('data', 'fsdp', 'expert')),
  ('act_length', None),
  ('act_mlp', 'tensor'),
  ('embed', 'fsdp'),
  ('mlp', 'tensor'),
  ('expert', 'expert'),
)


MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')


@pytest.mark.parametrize('impl', ['xla', 'xla_blocked'])
@pytest.mark.parametrize('shape', [(2, 1, 1, 4), (1, 2, 1, 4)], ids=['data2xexpert4', 'fsdp2xexpert4'])
def test_sharded_layer_matches_one_device(shape, impl):
  assert len(jax.devices()) == 8, 'tests/conftest.py should give 8 fake CPU devices'
  kw = CASES['sigmoid_groups_shared']
  # 8 sequences of 4: the batch splits over all 8 devices (the shared SwiGLU constrains its
  # activations' batch to 'act_batch').
  layer, params, moe_state, x, dy = _setup(kw, seed=1, b=8, t=4, impl=impl)
  step = jax.jit(jax.value_and_grad(lambda p, x: _loss(layer, p, moe_state, x, dy), argnums=(0, 1), has_aux=True))
  (ref_loss, (ref_y, ref_stats)), ref_g = step(params, x)

  mesh = jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    logical = nn.get_partition_spec(jax.eval_shape(layer.init, jax.random.key(0), x))['params']
    shardings = nn.logical_to_mesh_sharding(logical, mesh, RULES)
    sharded = jax.device_put(params, shardings)
    xs = jax.device_put(x, NamedSharding(mesh, P(('data', 'fsdp', 'expert'))))
    (loss, (y, stats)), g = step(sharded, xs)
  assert sharded['wi_gate'].sharding.shard_shape(sharded['wi_gate'].shape)[0] == kw['num_experts'] // 4
  assert_close(loss, ref_loss, 1e-5, 'loss')
  assert_close(y, ref_y, 1e-5, 'y')
  np.testing.assert_array_equal(stats['load'], ref_stats['load'])
  for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref_g)):
    assert_close(got, want, 1e-5, jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- the train step's helpers


def test_step_helpers_on_a_two_layer_model():
  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = x + MoE(num_experts=4, top_k=2, expert_hidden=F, aux_loss_alpha=0.1, name='layer_0')(x)
      return MoE(num_experts=6, top_k=1, expert_hidden=F, aux_loss_alpha=0.2, name='layer_1')(x)

  model = Two()
  x = jax.random.normal(jax.random.key(5), (B, T, D))
  variables = random_variables(model, x, seed=6)
  state = variables[MOE_STATE]
  assert jax.tree.map(jnp.shape, state) == {'layer_0': {'bias': (4,)}, 'layer_1': {'bias': (6,)}}
  _, mut = jax.jit(lambda v, x: model.apply(v, x, mutable=[MOE_STATS]))(
    {'params': variables['params'], MOE_STATE: state}, x
  )
  stats = mut[MOE_STATS]
  assert float(moe_aux_loss(stats)) == pytest.approx(float(stats['layer_0']['aux_loss'] + stats['layer_1']['aux_loss']))
  assert float(moe_aux_loss({})) == 0.0
  new = update_moe_state(state, stats, rate=0.5)
  for name in ('layer_0', 'layer_1'):
    load = np.asarray(stats[name]['load'])
    np.testing.assert_allclose(new[name]['bias'], 0.5 * np.sign(load.mean() - load))
    assert load.sum() == B * T * (2 if name == 'layer_0' else 1)
  metrics = moe_metrics(new, stats)
  assert set(metrics) == {'layer_0', 'layer_1'}
  load = np.asarray(stats['layer_1']['load'])
  assert float(metrics['layer_1']['load_max_over_mean']) == pytest.approx(load.max() / load.mean())
  assert float(metrics['layer_1']['bias_range']) == pytest.approx(float(np.ptp(new['layer_1']['bias'])))
  assert set(metrics['layer_0']) >= {'load_cv', 'router_entropy', 'aux_loss', 'bias_min', 'bias_max'}
  with pytest.raises(ValueError, match='no load for the bias at layer_1/bias'):
    update_moe_state(state, {'layer_0': stats['layer_0']})
