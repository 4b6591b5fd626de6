"""The MoE MLP kind in kimijax.model.Transformer (model.mlp_kind='moe'): which layers get it, the
parameter counts (total and active) against a hand count, one expert with top-1 equal to the
dense model with the same weights, remat keeping the router statistics, and the biases every
apply must pass. The layer itself is checked against the float64 oracle in
tests/layers/test_moe_layer.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cross_entropy, random_tokens, rel_err

from kimijax import config as config_lib
from kimijax.layers.moe import MOE_STATE, MOE_STATS, moe_aux_loss
from kimijax.model import Transformer, count_params, parameter_counts, variables

V, D, L, H, F_DENSE = 37, 32, 4, 4, 48


def moe_config(**moe):
  c = config_lib.base_config()
  c.model.update(
    vocab_size=V, d_model=D, num_layers=L, num_heads=H, mlp_dim=F_DENSE, compute_dtype='float32', mlp_kind='moe'
  )
  c.model.moe.update(moe)
  return config_lib.validate(c).model


def random_variables(cfg, seed=0, std=0.3):
  """N(0, std) params (norm gains 1) and zero biases: only the structure comes from the model."""
  shapes = nn.unbox(jax.eval_shape(Transformer(cfg).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  rng = np.random.default_rng(seed)
  draw = lambda p, s: jnp.asarray(
    np.ones(s.shape) if 'scale' in jax.tree_util.keystr(p) else std * rng.standard_normal(s.shape), s.dtype
  )
  params = jax.tree_util.tree_map_with_path(draw, shapes['params'])
  return params, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get(MOE_STATE, {}))


def test_moe_layers_and_parameter_counts_match_a_hand_count():
  cfg = moe_config(num_experts=4, top_k=2, num_shared=1, first_dense_layers=1)  # expert hidden 48 // 3 = 16
  params, moe_state = random_variables(cfg)
  f = 16
  assert config_lib.moe_hidden(cfg) == (f, F_DENSE)
  assert set(params['layer_0']['mlp']) == {'wi_gate', 'wi_up', 'wo'}  # the dense first layer
  assert params['layer_0']['mlp']['wi_gate'].shape == (D, F_DENSE)
  for i in range(1, L):
    mlp = params[f'layer_{i}']['mlp']
    assert mlp['router'].shape == (D, 4) and mlp['wi_gate'].shape == (4, D, f) and mlp['wo'].shape == (4, f, D)
    assert mlp['shared']['wi_gate'].shape == (D, f)
    assert moe_state[f'layer_{i}']['mlp']['bias'].shape == (4,)
  assert set(moe_state) == {'layer_1', 'layer_2', 'layer_3'}

  attention, norms = 4 * D * D, 2 * D
  router, routed, shared = D * 4, 4 * 3 * D * f, 3 * D * f
  total = V * D + D + L * (attention + norms) + 3 * D * F_DENSE + (L - 1) * (router + routed + shared)
  active = total - (L - 1) * (4 - 2) * 3 * D * f  # two of the four experts per token
  counts = parameter_counts(cfg)
  assert count_params(params) == counts['total'] == total
  assert counts['active'] == active
  assert counts['moe router'] == (L - 1) * router and counts['moe routed experts'] == (L - 1) * routed
  assert counts['moe shared experts'] == (L - 1) * shared and counts['mlp'] == 3 * D * F_DENSE
  assert 'active' not in parameter_counts(config_lib.validate(config_lib.base_config()).model)


def test_one_expert_with_top1_is_the_dense_model():
  """With one routed expert, top-1, renormalised weights (1) and scaling 1, every MoE layer is the
  dense SwiGLU of that expert's weights: logits and gradients equal the dense Transformer's."""
  cfg = moe_config(num_experts=1, top_k=1, num_shared=0, expert_hidden=F_DENSE, first_dense_layers=0)
  dense_cfg = cfg.copy_and_resolve_references()
  dense_cfg.mlp_kind = 'dense'
  params, moe_state = random_variables(cfg, seed=1)
  as_dense = lambda p: {
    k: ({**v, 'mlp': {n: v['mlp'][n][0] for n in ('wi_gate', 'wi_up', 'wo')}} if k.startswith('layer_') else v)
    for k, v in p.items()
  }
  tokens = random_tokens(cfg, b=2, t=9)
  loss_moe = lambda p: cross_entropy(Transformer(cfg).apply(variables(p, moe_state), tokens)[0], tokens)
  loss_dense = lambda p: cross_entropy(Transformer(dense_cfg).apply({'params': p}, tokens)[0], tokens)
  with jax.default_matmul_precision('highest'):
    (l_moe, g_moe), (l_dense, g_dense) = (
      jax.jit(jax.value_and_grad(loss_moe))(params),
      jax.jit(jax.value_and_grad(loss_dense))(as_dense(params)),
    )
  assert abs(float(l_moe) - float(l_dense)) <= 1e-6 * abs(float(l_dense))
  flat_dense = dict(jax.tree_util.tree_leaves_with_path(g_dense))
  for path, g in jax.tree_util.tree_leaves_with_path(as_dense(g_moe)):  # the router's gradient is dropped (~0)
    assert rel_err(g, np.asarray(flat_dense[path], np.float64)) <= 1e-5, jax.tree_util.keystr(path)


@pytest.mark.long  # ~25 s
def test_remat_keeps_the_router_statistics_and_the_gradients():
  """The statistics sown inside rematerialised layers reach the caller, and the loss with the
  balance loss and its gradients are those of the plain model."""
  cfg = moe_config(num_experts=4, top_k=2, aux_loss_alpha=0.1)
  remat = cfg.copy_and_resolve_references()
  remat.remat = True
  params, moe_state = random_variables(cfg, seed=2)
  tokens = random_tokens(cfg, b=2, t=9)

  def loss(model, p):
    (logits, _), mut = model.apply(variables(p, moe_state), tokens, mutable=[MOE_STATS])
    return cross_entropy(logits, tokens) + moe_aux_loss(mut[MOE_STATS]), mut[MOE_STATS]

  (l0, s0), g0 = jax.jit(jax.value_and_grad(lambda p: loss(Transformer(cfg), p), has_aux=True))(params)
  (l1, s1), g1 = jax.jit(jax.value_and_grad(lambda p: loss(Transformer(remat), p), has_aux=True))(params)
  assert set(s1) == {'layer_1', 'layer_2', 'layer_3'} and float(moe_aux_loss(s1)) > 0
  for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  assert float(l0) == pytest.approx(float(l1), rel=1e-6)
  # float32 summed in another order where remat changes XLA's fusions: ~1e-5 on the attention keys
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree.leaves(g1)):
    assert rel_err(b, np.asarray(a, np.float64)) <= 3e-5, jax.tree_util.keystr(path)


def test_pallas_runs_the_model_with_the_configs_kernel_settings():
  """model.moe.impl='pallas' (interpreted) with model.kernels.moe reaching each MoE layer as a
  MoeSettings: the logits equal lax.ragged_dot's ('xla') on the same variables."""
  from kernels_pallas.moe.settings import MoeSettings
  from kimijax.model import make_mlp

  c = config_lib.base_config()
  c.model.update(
    vocab_size=V, d_model=D, num_layers=2, num_heads=H, mlp_dim=F_DENSE, compute_dtype='float32', mlp_kind='moe'
  )
  c.model.moe.update(num_experts=4, top_k=2, impl='pallas')
  c.model.kernels.moe = 'block_m=16/block_n=16/block_k=16'
  cfg = config_lib.validate(c).model
  assert make_mlp(cfg, 1, jnp.float32).settings == MoeSettings(block_m=16, block_n=16, block_k=16)
  xla = cfg.copy_and_resolve_references()
  xla.moe.impl, xla.kernels.moe = 'xla', ''
  params, moe_state = random_variables(cfg, seed=3)
  tokens = random_tokens(cfg, b=2, t=9)
  logits = lambda model: jax.jit(model.apply)(variables(params, moe_state), tokens)[0]
  with jax.default_matmul_precision('highest'):
    assert rel_err(logits(Transformer(cfg)), np.asarray(logits(Transformer(xla)), np.float64)) <= 1e-5


def test_an_apply_without_the_biases_fails_naming_them():
  cfg = moe_config()
  params, _ = random_variables(cfg)
  with pytest.raises(Exception, match='moe_state'):
    Transformer(cfg).apply({'params': params}, random_tokens(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize('impl', ['tokamax', 'xla_blocked'])
def test_gpu_grouped_matmuls_train_the_model_as_lax_ragged_dot(impl):
  """On the GPU, in bf16: the model's loss and the gradient of every parameter with the MoE layers
  on `impl`, against the float32 model at full matmul precision (the routing fixed by the same
  biases), no further off than the bf16 model on lax.ragged_dot ('xla'): relative RMSE at most
  1.25x 'xla''s plus 1e-2, the loss within 5e-3. (Two bf16 implementations round at different
  places, so against each other they differ by more than either does from float32 at some
  tensors; at this size a few near-tied routing choices flip in bf16 too.)"""
  from helpers import rel_rmse

  base = dict(num_experts=8, top_k=2, num_shared=1, expert_hidden=64, aux_loss_alpha=0.01)

  def model_config(impl, dtype):
    c = config_lib.base_config()
    c.model.update(vocab_size=256, d_model=64, num_layers=2, num_heads=1, mlp_dim=192, mlp_kind='moe')
    c.model.compute_dtype = dtype
    c.model.moe.update(base, impl=impl, first_dense_layers=0)
    return config_lib.validate(c).model

  reference = model_config('xla', 'float32')
  params, moe_state = random_variables(reference, seed=3, std=0.1)
  tokens = random_tokens(reference, b=8, t=128)

  def loss_and_grads(cfg):
    def loss(p):
      (logits, _), mut = Transformer(cfg).apply(variables(p, moe_state), tokens, mutable=[MOE_STATS])
      return cross_entropy(logits, tokens) + moe_aux_loss(mut[MOE_STATS])

    return jax.jit(jax.value_and_grad(loss))(params)

  with jax.default_matmul_precision('highest'):
    l_ref, g_ref = loss_and_grads(reference)
  (l_xla, g_xla), (l_got, g_got) = (loss_and_grads(model_config(n, 'bfloat16')) for n in ('xla', impl))
  assert abs(float(l_got) - float(l_ref)) <= 5e-3 * abs(float(l_ref))
  for (path, ref), xla, got in zip(
    jax.tree_util.tree_leaves_with_path(g_ref), jax.tree.leaves(g_xla), jax.tree.leaves(g_got)
  ):
    ref = np.asarray(ref, np.float64)
    assert rel_rmse(got, ref) <= 1.25 * rel_rmse(xla, ref) + 1e-2, jax.tree_util.keystr(path)
