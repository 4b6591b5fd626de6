"""Muon (kimijax.optim.muon) against a float64 NumPy transcription of Moonlight's update, the
AdamW side against a NumPy AdamW, the default routing of the model's parameters, per-head
stacks, and the sharded update on 8 fake CPU devices against the one-device update.

The references (tests/oracles.py) are written from docs/optimizers.md#muon alone (momentum M = mu M + G without bias
correction, Nesterov G + mu M, NS5 on N / (||N||_F + 1e-7) with (3.4445, -4.7750, 2.0315),
transposed when rows > cols, update lr (0.2 sqrt(max(A, B)) O + wd W)) and the AdamW paper.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import NpAdamW, NpMuon, np_ns5

from kimijax import config as config_lib
from kimijax.config import ConfigError
from kimijax.model import Transformer
from kimijax.optim import describe, make_optimizer, muon
from kimijax.optim.muon import ScaleByMuonState, newton_schulz
from kimijax.optim.routing import MatrixView, Routing
from kimijax.parallel import mesh as mesh_lib
from kimijax.train.state import init_state, state_shardings

RTOL = 1e-5


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return np.linalg.norm(got - want) / np.linalg.norm(want)


def run_optimizer(opt, params, grads_seq):
  """Applies `opt` for each gradient pytree; returns the final params as float64 numpy."""
  state = opt.init(params)
  update = jax.jit(opt.update)
  for grads in grads_seq:
    updates, state = update(grads, state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
  return jax.tree.map(lambda x: np.asarray(x, np.float64), params)


def random_tree(shapes, rng, scale=1.0):
  return jax.tree.map(
    lambda s: jnp.asarray(scale * rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda s: isinstance(s, tuple)
  )


SHAPES = {
  'embed': (40, 24),  # -> adamw (embedding)
  'final_norm': {'scale': (24,)},  # -> adamw (1-D)
  'layer_0': {
    'mlp': {'wide': (16, 48), 'tall': (40, 12)},  # 2-D -> muon, one matrix each
    'attention': {
      'query': (24, 4, 6),  # -> muon, [24, 4*6]
      'out': (4, 6, 24),
    },  # -> muon, [4*6, 24]
    'bias': (12,),  # -> adamw
  },
}
# How each Muon parameter looks as a matrix under the default view.
FUSED = {
  ('layer_0', 'mlp', 'wide'): lambda w: w,
  ('layer_0', 'mlp', 'tall'): lambda w: w,
  ('layer_0', 'attention', 'query'): lambda w: w.reshape(24, 24),
  ('layer_0', 'attention', 'out'): lambda w: w.reshape(24, 24),
}


def leaves_by_path(tree):
  from kimijax.optim.routing import path_names

  return {path_names(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
  'nesterov,wd,scheduled',
  [(True, 0.1, True), (False, 0.0, False), (True, 0.0, False)],
  ids=['nesterov-wd-schedule', 'plain', 'nesterov'],
)
def test_matches_numpy_moonlight_and_adamw(nesterov, wd, scheduled):
  steps, peak = 6, 0.02
  schedule = (lambda count: peak * (count + 1) / steps) if scheduled else peak
  lr_at = (lambda t: peak * (t + 1) / steps) if scheduled else (lambda t: peak)
  rng = np.random.default_rng(0)
  params = random_tree(SHAPES, rng, 0.1)
  grads_seq = [random_tree(SHAPES, rng) for _ in range(steps)]
  opt = muon(schedule, nesterov=nesterov, weight_decay=wd, ns_dtype=jnp.float32)
  got = leaves_by_path(run_optimizer(opt, params, grads_seq))

  init = leaves_by_path(params)
  grads = [leaves_by_path(g) for g in grads_seq]
  for path, w0 in init.items():
    w0 = np.asarray(w0, np.float64)
    if path in FUSED:
      view = FUSED[path]
      ref = NpMuon(view(w0), nesterov=nesterov, wd=wd)
      for t in range(steps):
        ref.step(view(np.asarray(grads[t][path])), lr_at(t))
      want, have = ref.w - view(w0), view(got[path]) - view(w0)
    else:
      ref = NpAdamW(w0, wd=wd)
      for t in range(steps):
        ref.step(grads[t][path], lr_at(t))
      want, have = ref.w - w0, got[path] - w0
    assert rel_err(have, want) <= RTOL, (path, rel_err(have, want))


@pytest.mark.parametrize('shape', [(3, 24, 40), (3, 40, 24)])
def test_newton_schulz_matches_numpy_wide_and_tall(shape):
  """newton_schulz keeps each matrix's shape and equals the float64 transcription (f32 NS)."""
  x = np.random.default_rng(5).standard_normal(shape)
  got = newton_schulz(jnp.asarray(x, jnp.float32), 5, jnp.float32)
  assert got.shape == shape
  for i in range(shape[0]):
    assert rel_err(got[i], np_ns5(x[i])) <= RTOL


def test_per_head_stacks_are_orthogonalised_one_by_one():
  """per_head=True: query [D, H, Dh] is H matrices [D, Dh], out [H, Dh, D] is H matrices [Dh, D],
  each with its own NS and sqrt(max(A, B)); an explicit MatrixView does the same for an
  expert-like stack [E, A, B] and a custom split of a 4-D kernel."""
  rng = np.random.default_rng(1)
  shapes = {'attention': {'query': (20, 3, 8), 'out': (3, 8, 20)}, 'experts': (3, 10, 14), 'conv4d': (2, 6, 5, 4)}
  params = random_tree(shapes, rng, 0.1)
  grads_seq = [random_tree(shapes, rng) for _ in range(3)]
  views = {
    'attention': {'query': None, 'out': None},
    'experts': None,
    'conv4d': MatrixView(stack=(2,), rows=(0, 3), cols=(1,)),
  }  # 5 matrices [2*4, 6]
  opt = muon(
    0.01, per_head=True, ns_dtype=jnp.float32, muon_views=views, muon_mask=jax.tree.map(lambda _: True, params)
  )
  got = leaves_by_path(run_optimizer(opt, params, grads_seq))
  init, grads = leaves_by_path(params), [leaves_by_path(g) for g in grads_seq]

  slicers = {
    ('attention', 'query'): (3, lambda w, i: w[:, i, :]),
    ('attention', 'out'): (3, lambda w, i: w[i]),
    ('experts',): (3, lambda w, i: w[i]),
    ('conv4d',): (5, lambda w, i: w[:, :, i, :].transpose(0, 2, 1).reshape(8, 6)),
  }
  for path, (count, take) in slicers.items():
    w0 = np.asarray(init[path], np.float64)
    for i in range(count):
      ref = NpMuon(take(w0, i))
      for g in grads:
        ref.step(take(np.asarray(g[path]), i), 0.01)
      assert rel_err(take(got[path], i) - take(w0, i), ref.w - take(w0, i)) <= RTOL, (path, i)


def test_muon_mask_overrides_default_routing():
  """muon_mask sends the embedding to Muon and one MLP matrix to AdamW."""
  rng = np.random.default_rng(2)
  params = random_tree(SHAPES, rng, 0.1)
  grads_seq = [random_tree(SHAPES, rng) for _ in range(3)]
  mask = jax.tree.map(lambda p: p.ndim >= 2, params)
  mask['embed'], mask['layer_0']['mlp']['wide'] = True, False
  opt = muon(0.01, ns_dtype=jnp.float32, muon_mask=mask, weight_decay=0.1)
  got = leaves_by_path(run_optimizer(opt, params, grads_seq))
  init, grads = leaves_by_path(params), [leaves_by_path(g) for g in grads_seq]
  for path, ref_cls in ((('embed',), NpMuon), (('layer_0', 'mlp', 'wide'), NpAdamW)):
    w0 = np.asarray(init[path], np.float64)
    ref = ref_cls(w0, wd=0.1)
    for g in grads:
      ref.step(g[path], 0.01)
    assert rel_err(got[path] - w0, ref.w - w0) <= RTOL, path
  with pytest.raises(ValueError, match='final_norm/scale'):
    bad = jax.tree.map(lambda _: True, params)
    muon(0.01, muon_mask=bad).init(params)


# ----------------------------------------------------------------------------- routing


def model_params(**overrides):
  c = config_lib.base_config()
  c.model.update(overrides)
  model = Transformer(c.model)
  return jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32))['params'], jax.random.key(0))


def test_default_routing_of_model_params():
  params = model_params(tie_embeddings=False)
  routes = leaves_by_path(Routing().routes(params))
  d, h = 256, 4
  for path, route in routes.items():
    leaf = path[-1]
    if leaf in ('embed', 'head') or 'norm' in '/'.join(path):
      assert route.rule == 'adamw', path
    else:
      assert route.rule == 'muon', path
  assert ('head',) in routes and ('embed',) in routes
  q, o = routes[('layer_0', 'attention', 'query')], routes[('layer_0', 'attention', 'out')]
  assert q.view == MatrixView((), (0,), (1, 2)) and q.view.sizes((d, h, d // h)) == (1, d, d)
  assert o.view == MatrixView((), (0, 1), (2,))
  assert routes[('layer_0', 'mlp', 'wo')].view == MatrixView((), (0,), (1,))
  # Per head: H matrices.
  q = leaves_by_path(Routing(per_head=True).routes(params))[('layer_0', 'attention', 'query')]
  assert q.view.sizes((d, h, d // h)) == (h, d, d // h)
  table = Routing().table(params)
  assert 'layer_0/attention/query' in table and '[256, 4*64]' in table and 'embedding' in table


def test_default_routing_of_kda_mla_and_attnres_names():
  """By name and shape, without building those layers: KDA's A_log, dt_bias and short-conv taps,
  AttnRes pseudo-queries and norm gains go to AdamW; projections to Muon with fused head views."""
  S = jax.ShapeDtypeStruct
  f32 = jnp.float32
  params = {
    'layer_0': {
      'kda': {
        'A_log': S((4,), f32),
        'dt_bias': S((4, 16), f32),
        'q_proj': S((64, 4, 16), f32),
        'o_proj': S((4, 16, 64), f32),
        'f_a': S((64, 16), f32),
        'f_b': S((16, 4, 16), f32),
        'q_conv': {'kernel': S((4, 4, 16), f32)},
        'o_norm': S((16,), f32),
      },
      'mla': {
        'q_nope': S((64, 4, 16), f32),
        'k_rope': S((64, 8), f32),
        'v': S((32, 4, 16), f32),
        'kv_norm': {'scale': S((32,), f32)},
      },
    },
    'attnres': {'layer_0_mlp': {'attnres_query': S((64,), f32)}},
  }
  routes = leaves_by_path(Routing().routes(params))
  rule = {p: r.rule for p, r in routes.items()}
  for name in ('A_log', 'dt_bias', 'o_norm'):
    assert rule[('layer_0', 'kda', name)] == 'adamw', name
  assert rule[('layer_0', 'kda', 'q_conv', 'kernel')] == 'adamw'
  assert rule[('layer_0', 'mla', 'kv_norm', 'scale')] == 'adamw'
  assert rule[('attnres', 'layer_0_mlp', 'attnres_query')] == 'adamw'
  sizes = {
    p: r.view.sizes(params_shape)
    for p, r in routes.items()
    if r.rule == 'muon'
    for params_shape in [leaves_by_path(params)[p].shape]
  }
  assert sizes[('layer_0', 'kda', 'q_proj')] == (1, 64, 64)
  assert sizes[('layer_0', 'kda', 'o_proj')] == (1, 64, 64)
  assert sizes[('layer_0', 'kda', 'f_b')] == (1, 16, 64)
  assert sizes[('layer_0', 'mla', 'v')] == (1, 32, 64)
  assert sizes[('layer_0', 'mla', 'k_rope')] == (1, 64, 8)


def test_config_names_optimizers():
  c = config_lib.base_config()
  for name in ('adamw', 'muon', 'muonclip'):
    c.optimizer.name = name
    config_lib.validate(c)
  c.optimizer.name = 'sgd'
  with pytest.raises(ConfigError, match="optimizer.name='sgd'.*muonclip"):
    config_lib.validate(c)
  c = config_lib.base_config()
  c.optimizer.ns_dtype = 'float16'
  with pytest.raises(ConfigError, match='optimizer.ns_dtype'):
    config_lib.validate(c)


# ----------------------------------------------------------------------------- sharded


def sharded_config(shape):
  c = config_lib.base_config()
  c.model.update(
    d_model=64,
    num_heads=8,
    num_kv_heads=4,
    attention_kind='gqa',
    vocab_size=256,
    num_layers=2,
    mlp_dim=96,
    compute_dtype='float32',
  )
  c.train.grad_clip = 0.0
  c.train.seq_len = 8
  c.optimizer.update(name='muon', ns_dtype='float32', schedule='constant', warmup_steps=0, learning_rate=1e-2)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = shape
  return config_lib.validate(c)


def muon_updates(config, devices, grads_seq):
  """(per-step updates as numpy, final opt_state, params, shardings, the update's compiled HLO)
  of the real optimizer under jit with the train state's shardings on `devices`, with the mesh
  set as the train step sets it."""
  mesh = mesh_lib.make_mesh(config.mesh, devices)
  model = Transformer(config.model)
  opt = make_optimizer(config)
  abstract, sh = state_shardings(model, opt, config, mesh)
  state = init_state(model, opt, config, abstract)
  grads_sh = [jax.device_put(grads, sh.params) for grads in grads_seq]
  with jax.set_mesh(mesh):
    update = (
      jax.jit(
        lambda g, s, p: opt.update(g, s, p, max_logits={}),
        in_shardings=(sh.params, sh.opt_state, sh.params),
        out_shardings=(sh.params, sh.opt_state),
      )
      .lower(grads_sh[0], state.opt_state, state.params)
      .compile()
    )
  apply = jax.jit(lambda p, u: jax.tree.map(jnp.add, p, u), out_shardings=sh.params)
  params, opt_state, out = state.params, state.opt_state, []
  for g in grads_sh:
    updates, opt_state = update(g, opt_state, params)
    params = apply(params, updates)
    out.append(jax.tree.map(np.asarray, updates))
  return out, opt_state, params, sh, update.as_text()


@pytest.mark.parametrize('split_matrices', [True, pytest.param(False, marks=pytest.mark.long)])  # ~50 s each
def test_sharded_muon_update_equals_one_device(split_matrices):
  """fsdp=2 x tensor=4 (and data=2 x fsdp=2 x tensor=2): every Muon and AdamW update of 3 steps
  equals the one-device update to rel 1e-5 (f32 NS), whether each device orthogonalises a share
  of whole matrices or each parameter is orthogonalised in its own layout, and the optimizer
  state is sharded like the parameters."""
  rng = np.random.default_rng(3)
  ref_cfg = sharded_config((1, 1, 1))
  abstract = model_params(
    **{
      k: ref_cfg.model[k]
      for k in ('d_model', 'num_heads', 'num_kv_heads', 'attention_kind', 'vocab_size', 'num_layers', 'mlp_dim')
    }
  )
  shapes = jax.tree.map(lambda x: x.shape, nn.unbox(abstract))
  grads_seq = [
    jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes, is_leaf=lambda s: isinstance(s, tuple))
    for _ in range(3)
  ]
  ref_updates, *_ = muon_updates(ref_cfg, jax.devices()[:1], grads_seq)

  for shape in ((1, 2, 4), (2, 2, 2)):
    config = sharded_config(shape)
    config.optimizer.muon_split_matrices = split_matrices
    updates, opt_state, params, sh, hlo = muon_updates(config, jax.devices(), grads_seq)
    # Splitting moves whole matrices between devices (all-to-all); the per-parameter layout does not.
    assert ('all-to-all(' in hlo) == split_matrices, shape
    for step, (got, want) in enumerate(zip(updates, ref_updates)):
      for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
        assert rel_err(g, w) <= RTOL, (shape, step, jax.tree_util.keystr(path), rel_err(g, w))

    # Sharded like the parameters: the state's shardings (from kimijax/train/state.py) and the
    # shards each device actually holds.
    q = params['layer_0']['attention']['query']
    assert q.sharding.spec[0] == ('fsdp' if shape[1] > 1 else None) and 'tensor' in str(q.sharding.spec)
    param_sh = leaves_by_path(sh.params)
    checked = 0
    for path, s in jax.tree_util.tree_flatten_with_path(sh.opt_state)[0]:
      names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey) and k.key not in ('muon', 'adamw'))
      if names in param_sh:
        assert s == param_sh[names], (names, s, param_sh[names])
        checked += 1
    rules = [r.rule for r in jax.tree.leaves(Routing().routes(abstract))]
    assert checked == rules.count('muon') + 2 * rules.count('adamw')  # momentum; Adam mu and nu
    momentum = [
      s
      for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ScaleByMuonState))
      if isinstance(s, ScaleByMuonState)
    ][0].momentum
    m_q = momentum['layer_0']['attention']['query']
    assert {x.data.shape for x in m_q.addressable_shards} == {x.data.shape for x in q.addressable_shards}
    assert m_q.addressable_shards[0].data.size < q.size


# ----------------------------------------------------------------------------- MoE


def test_moe_routers_and_expert_stacks():
  """The MoE layer's parameters: the router [D, E] on Muon as one matrix (Moonlight), or on AdamW
  with optimizer.moe_router='adamw'; the stacked experts as E matrices each; the routing table
  says so."""
  params = model_params(mlp_kind='moe')  # 8 experts of hidden 768 // 3 = 256, layers 1-3
  routes = leaves_by_path(Routing().routes(params))
  router = routes[('layer_1', 'mlp', 'router')]
  assert router.rule == 'muon' and router.reason == 'MoE router' and router.view.sizes((256, 8)) == (1, 256, 8)
  for name, shape in (('wi_gate', (8, 256, 256)), ('wo', (8, 256, 256))):
    route = routes[('layer_1', 'mlp', name)]
    assert route.rule == 'muon' and route.view.sizes(shape) == (8, 256, 256) and 'MoE experts' in route.reason
  assert routes[('layer_1', 'mlp', 'shared', 'wi_gate')].view.sizes((256, 256)) == (1, 256, 256)
  assert routes[('layer_0', 'mlp', 'wi_gate')].reason == 'hidden matrix'  # the dense first layer
  assert leaves_by_path(Routing(router='adamw').routes(params))[('layer_1', 'mlp', 'router')].rule == 'adamw'
  table = Routing().table(params)
  assert 'layer_1/mlp/router' in table and 'MoE router' in table and '8 x [256, 256]' in table
  c = config_lib.base_config()
  c.optimizer.update(name='muon', moe_router='adamw')
  c.model.mlp_kind = 'moe'
  config_lib.validate(c)
  row = next(r for r in describe(c, params).splitlines() if r.startswith('layer_1/mlp/router'))
  assert row.split()[3:5] == ['adamw', '-'], row


def test_each_expert_is_orthogonalised_and_scaled_on_its_own():
  """Muon on stacked experts [E, A, B] equals Moonlight's update of each expert matrix alone
  (NS5 of that matrix, scaled by 0.2 sqrt(max(A, B)) of that matrix), for the up-projections
  [E, D, F] and the down-projections [E, F, D]; the router [D, E] is one matrix."""
  e, d, f, steps, lr = 4, 24, 40, 3, 0.02
  shapes = {'layer_1': {'mlp': {'router': (d, e), 'wi_gate': (e, d, f), 'wo': (e, f, d)}}}
  rng = np.random.default_rng(3)
  params = random_tree(shapes, rng, 0.1)
  grads_seq = [random_tree(shapes, rng) for _ in range(steps)]
  for t in grads_seq:  # experts of very different gradient scales: a shared normalisation would mix them
    mlp = t['layer_1']['mlp']
    for name in ('wi_gate', 'wo'):
      mlp[name] = mlp[name] * jnp.asarray([1.0, 10.0, 0.1, 3.0])[:, None, None]
  got = run_optimizer(muon(lr, ns_dtype=jnp.float32), params, grads_seq)['layer_1']['mlp']
  w0 = jax.tree.map(lambda x: np.asarray(x, np.float64), params)['layer_1']['mlp']
  grads = [g['layer_1']['mlp'] for g in grads_seq]
  for name in ('wi_gate', 'wo'):
    for i in range(e):
      ref = NpMuon(w0[name][i])
      for g in grads:
        ref.step(np.asarray(g[name][i]), lr)
      assert rel_err(got[name][i] - w0[name][i], ref.w - w0[name][i]) <= RTOL, (name, i)
  ref = NpMuon(w0['router'])
  for g in grads:
    ref.step(np.asarray(g['router']), lr)
  assert rel_err(got['router'] - w0['router'], ref.w - w0['router']) <= RTOL
