"""The Kimi Delta Attention layer (docs/kda.md) against a float64 NumPy transcription, and its decode
path (conv states + float32 state) against its parallel path, token by token (the oracle:
tests/oracles.py); its output norm's eps set from the config."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracles import np_kda_layer, np_rmsnorm, np_silu

from kimijax.config import ConfigError, base_config, validate
from kimijax.layers.kda import KimiDeltaAttention
from kimijax.model import make_mixer

B, T, D, H, K = 2, 13, 24, 3, 8


CASES = {
  'default': dict(short_conv=True, output_gate='sigmoid', gate_lower_bound=0.0),
  'swish_noconv_bounded': dict(short_conv=False, output_gate='swish', gate_lower_bound=-5.0),
  'no_gate': dict(short_conv=True, output_gate='none', gate_lower_bound=0.0),
}


def _setup(case, impl='xla', head_dim=K, short_conv_impl='xla'):
  layer = KimiDeltaAttention(H, head_dim, impl=impl, init_std=0.3, short_conv_impl=short_conv_impl, **case)
  x = jax.random.normal(jax.random.key(1), (B, T, D))
  params = nn.unbox(layer.init(jax.random.key(0), x)['params'])
  return layer, params, x


@pytest.mark.parametrize('case', CASES.values(), ids=CASES.keys())
def test_layer_matches_numpy(case):
  layer, params, x = _setup(case)
  y, max_logits, cache = layer.apply({'params': params}, x)
  ref = np_kda_layer(
    params,
    np.asarray(x, np.float64),
    short_conv=case['short_conv'],
    output_gate=case['output_gate'],
    lower_bound=case['gate_lower_bound'],
  )
  assert max_logits is None and cache is None
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_layer_with_the_fused_conv_kernels_matches_numpy():
  """short_conv_impl='pallas' (K = 16, the kernels' smallest head dim) against the NumPy layer."""
  layer, params, x = _setup(CASES['default'], head_dim=16, short_conv_impl='pallas')
  ref = np_kda_layer(params, np.asarray(x, np.float64), short_conv=True, output_gate='sigmoid', lower_bound=0.0)
  np.testing.assert_allclose(layer.apply({'params': params}, x)[0], ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


@pytest.mark.long
def test_layer_with_the_fused_conv_kernels_has_the_plain_convs_gradients():
  """Every parameter's gradient with short_conv_impl='pallas' against the layer with the XLA convs."""
  case = CASES['default']
  layer, params, x = _setup(case, head_dim=16, short_conv_impl='pallas')
  plain = KimiDeltaAttention(H, 16, init_std=0.3, **case)
  grads = [jax.grad(lambda p, m=m: jnp.sum(m.apply({'params': p}, x)[0] ** 2))(params) for m in (layer, plain)]
  for path, got in jax.tree_util.tree_leaves_with_path(grads[0]):
    want = functools.reduce(lambda tree, key: tree[key.key], path, grads[1])
    np.testing.assert_allclose(
      got, want, rtol=1e-4, atol=1e-5 * float(jnp.abs(want).max()), err_msg=jax.tree_util.keystr(path)
    )


def test_parameter_initialisation():
  _, params, _ = _setup(CASES['default'])
  a = np.exp(np.asarray(params['A_log']))
  assert params['A_log'].shape == (H,) and np.all((a >= 1) & (a <= 16))
  dt = np.log1p(np.exp(np.asarray(params['dt_bias'], np.float64)))  # softplus(dt_bias) = dt
  assert params['dt_bias'].shape == (H, K) and np.all((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001))


@pytest.mark.parametrize('case', CASES.values(), ids=CASES.keys())
def test_prefill_then_decode_equals_parallel(case):
  layer, params, x = _setup(case)
  y_full, _, _ = layer.apply({'params': params}, x)
  cache = KimiDeltaAttention.init_cache(B, H, K, case['short_conv'], jnp.float32)
  prompt = 6
  y, _, cache = layer.apply({'params': params}, x[:, :prompt], None, cache)
  outs = [y]
  for t in range(prompt, T):
    y, _, cache = layer.apply({'params': params}, x[:, t : t + 1], None, cache)
    outs.append(y)
  assert cache['state'].dtype == jnp.float32 and cache['state'].shape == (B, H, K, K)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), y_full, rtol=1e-4, atol=1e-5 * float(jnp.abs(y_full).max()))


@pytest.mark.parametrize('recompute', ['', 'qk', 'qkv'], ids=['keep_projections', 'recompute_qk', 'recompute_qkv'])
@pytest.mark.parametrize('case', ['default', 'swish_noconv_bounded'])
def test_backward_keeps_only_matmul_outputs_and_the_named_residuals(case, recompute):
  """What the layer's backward keeps, per token, is bounded by: 5 bf16 tensors of H * K (the layer
  input, the q/k/v projections, the op's output; one fewer for each recomputed projection), the fused op's two
  named residuals aqk and T (bf16, H * C each with C = 64), at most two rank-K bottlenecks of the
  gate projections (bf16) and beta (float32, H, twice). The op's inputs (q, k, v after conv + SiLU +
  L2 norm, the float32 g), the gate projections' outputs and the elementwise intermediates are
  recomputed: keeping the op's inputs and the projections took 26 bytes per token and channel at
  K = 128, their float32 intermediates 99."""
  bsz, t, h, k, c = 2, 256, 4, 32, 64
  layer = KimiDeltaAttention(h, k, impl='pallas', dtype=jnp.bfloat16, recompute_projections=recompute, **CASES[case])
  x = jnp.zeros((bsz, t, h * k), jnp.bfloat16)
  params = jax.eval_shape(layer.init, jax.random.key(0), x)
  loss = lambda p, x: jnp.sum(layer.apply(p, x)[0].astype(jnp.float32))
  residuals = jax.eval_shape(lambda p, x: jax.vjp(loss, p, x)[1], params, x)
  kept = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(residuals))
  per_token = 2 * (5 - len(recompute)) * h * k + 2 * 2 * h * c + 2 * 2 * k + 4 * 2 * h
  assert kept <= per_token * bsz * t + 4 * sum(a.size for a in jax.tree_util.tree_leaves(params)), kept / (bsz * t)


@pytest.mark.parametrize('recompute', ['v', 'qkv'])
def test_recomputed_projections_give_the_same_gradients(recompute):
  case = CASES['default']
  layer, params, x = _setup(case)
  again = KimiDeltaAttention(H, K, init_std=0.3, recompute_projections=recompute, **case)
  grads = [jax.grad(lambda p, m=m: jnp.sum(m.apply({'params': p}, x)[0] ** 2))(params) for m in (layer, again)]
  for got, want in zip(jax.tree_util.tree_leaves(grads[1]), jax.tree_util.tree_leaves(grads[0])):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(jnp.abs(want).max()))


def np_kda_layer_no_conv_no_gate(p, x, *, eps):
  """docs/kda.md without short conv and output gate; the per-head output RMSNorm with `eps`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
  q, k, v = (np.einsum('btd,dhk->bthk', x, p[f'{n}_proj']) for n in 'qkv')
  l2 = lambda a: a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6)
  q, k, v = l2(np_silu(q)), l2(np_silu(k)), np_silu(v)
  beta = 1 / (1 + np.exp(-np.einsum('btd,dh->bth', x, p['b_proj'])))
  f = np.einsum('btr,rhk->bthk', x @ p['f_a'], p['f_b']) + p['dt_bias']
  g = -np.exp(p['A_log'])[:, None] * np.log1p(np.exp(f))
  dk = q.shape[-1]
  s = np.zeros((x.shape[0], q.shape[2], dk, dk))
  o = np.zeros(q.shape)
  for t in range(x.shape[1]):
    s = s * np.exp(g[:, t])[..., None]
    pred = np.einsum('bhkv,bhk->bhv', s, k[:, t])
    s = s + np.einsum('bhk,bhv->bhkv', k[:, t], beta[:, t, :, None] * (v[:, t] - pred))
    o[:, t] = np.einsum('bhkv,bhk->bhv', s, q[:, t] * dk**-0.5)
  o = np_rmsnorm(o, p['o_norm'], eps)
  return np.einsum('bthk,hkd->btd', o, p['o_proj'])


def test_kda_output_norm_eps_comes_from_the_config():
  eps = 0.05  # large enough to change the output visibly against the old fixed 1e-5
  c = base_config()
  c.model.update(
    d_model=32,
    num_heads=4,
    init_std=0.3,
    compute_dtype='float32',
    kda_output_norm_eps=eps,
    kda_short_conv=False,
    kda_output_gate='none',
    kda_impl='xla_recurrent',
  )
  mixer = make_mixer(validate(c).model, 'K', jnp.float32)
  x = jax.random.normal(jax.random.key(3), (B, 9, 32))
  params = nn.unbox(mixer.init(jax.random.key(0), x, None)['params'])
  y, _, _ = mixer.apply({'params': params}, x)
  ref = np_kda_layer_no_conv_no_gate(params, np.asarray(x, np.float64), eps=eps)
  np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5 * np.abs(ref).max())


def test_output_norm_eps_is_validated():
  c = base_config()
  c.model.kda_output_norm_eps = -1.0
  with pytest.raises(ConfigError, match=r'model.kda_output_norm_eps=-1.0 must be positive'):
    validate(c)
