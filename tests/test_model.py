"""Tests for kimijax.model.Transformer and RoPE against float64 NumPy (tests/oracles.py).

The NumPy forward reads the model's own parameter pytree but none of its code: embedding
lookup, RMSNorm with gain, GQA attention with RoPE (complex-number rotation), SwiGLU, final norm
and the tied or untied head.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import B, T, cross_entropy, forward, init_params, random_tokens, rel_err, tiny_model_config
from oracles import matrix, np_forward, np_rope

from kimijax import config as config_lib
from kimijax.layers.rope import Yarn, apply_rope
from kimijax.model import Transformer, count_params


@pytest.fixture(autouse=True)
def _float32_matmuls_in_full():
  """GPUs run float32 matmuls as TF32 by default; these tests compare with float64 at ~1e-5."""
  with jax.default_matmul_precision('highest'):
    yield


# ----------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize('theta', [10000.0, 500.0])
def test_apply_rope_matches_pair_rotation(theta):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 6, 3, 16)).astype(np.float32)
  positions = rng.integers(0, 64, (2, 6))
  got = apply_rope(jnp.asarray(x), jnp.asarray(positions), theta)
  assert got.dtype == jnp.float32 and got.shape == x.shape
  np.testing.assert_allclose(
    got, np_rope(x.astype(np.float64), positions.astype(np.float64), theta), rtol=1e-5, atol=1e-5
  )
  # Explicit check of one pair against the written-out 2-D rotation.
  i, d, pos = 3, 16, float(positions[1, 4])
  ang = pos * theta ** (-2 * i / d)
  a, b = x[1, 4, 2, i], x[1, 4, 2, i + d // 2]
  np.testing.assert_allclose(
    got[1, 4, 2, [i, i + d // 2]],
    [a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)],
    rtol=1e-5,
    atol=1e-5,
  )
  # Position 0 is the identity; bf16 input keeps its dtype.
  np.testing.assert_array_equal(apply_rope(jnp.asarray(x), jnp.zeros((2, 6)), theta), x)
  assert apply_rope(jnp.asarray(x, jnp.bfloat16), jnp.asarray(positions), theta).dtype == jnp.bfloat16


def test_rope_logits_depend_only_on_relative_offset():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((1, 8, 2, 16)), jnp.float32)
  pos = jnp.asarray(rng.integers(0, 30, (1, 8)))
  logits = lambda p: jnp.einsum('bihd,bjhd->bhij', apply_rope(q, p, 1e4), apply_rope(k, p, 1e4))
  base = logits(pos)
  for shift in (1, 17, 250):
    np.testing.assert_allclose(logits(pos + shift), base, rtol=1e-4, atol=1e-4)
  # ...whereas changing the offsets does change them.
  assert np.max(np.abs(logits(pos * 2) - base)) > 1e-1


def test_yarn_keeps_fast_frequencies_and_interpolates_slow_ones():
  """YaRN's closed forms (arXiv 2309.00071): a frequency turning more than beta_fast times over the
  original context is kept, one turning fewer than beta_slow times is divided by the factor, those
  between lie between; m(s) = 0.1 ln s + 1 scales the rotation; factor 1 is plain RoPE."""
  d, theta, original, factor = 64, 1e4, 4096, 40.0
  yarn = Yarn(factor, original)
  freq = theta ** (-np.arange(0, d, 2) / d)
  turns = original * freq / (2 * np.pi)
  got = yarn.inv_freq(d, theta)
  fast, slow = turns > 32 * 1.5, turns < 1 / 1.5  # clear of the ramp's rounded ends
  assert fast.any() and slow.any() and (~fast & ~slow).any()
  np.testing.assert_allclose(got[fast], freq[fast], rtol=1e-6)
  np.testing.assert_allclose(got[slow], freq[slow] / factor, rtol=1e-6)
  assert np.all((got <= freq * (1 + 1e-6)) & (got >= freq / factor * (1 - 1e-6)))
  assert np.isclose(yarn.attention_factor(), 0.1 * np.log(factor) + 1) and yarn.softmax_multiplier() == 1.0
  deepseek = Yarn(factor, original, mscale=1.0, mscale_all_dim=1.0)
  assert deepseek.attention_factor() == 1.0 and np.isclose(deepseek.softmax_multiplier(), (0.1 * np.log(40) + 1) ** 2)
  x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 5, 2, d)), jnp.float32)
  positions = jnp.arange(0, 50, 10)[None]
  np.testing.assert_allclose(
    apply_rope(x, positions, theta, Yarn(1.0, original)), apply_rope(x, positions, theta), rtol=1e-5, atol=1e-5
  )


# ----------------------------------------------------------------------------- whole model


@pytest.mark.parametrize('file', ['configs/kimi_linear_moe.py', 'configs/moonlight_small.py', 'configs/default.py'])
def test_bfloat16_inference_params_give_the_logits_of_rounded_float32_ones(file):
  """kimijax.model.inference_params with bf16 compute: the matrices held in bfloat16 give bitwise
  the logits and the greedy tokens of float32 parameters rounded to bfloat16 (each matrix is cast
  to the compute dtype where used, or promoted to float32 exactly; vectors stay float32)."""
  from kimijax.infer.generate import generate
  from kimijax.model import as_variables, inference_params, inference_variables

  config = config_lib.load(file, overrides={'model.compute_dtype': 'bfloat16'})
  model = Transformer(config_lib.portable(config.model))
  variables = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  params, moe_state = nn.unbox(variables['params']), dict(variables.get('moe_state', {}))
  held = inference_params(params, 'bfloat16')
  assert {str(x.dtype) for x in jax.tree.leaves(held) if x.ndim >= 2} == {'bfloat16'}
  assert {str(x.dtype) for x in jax.tree.leaves(held) if x.ndim < 2} == {'float32'}
  rounded = jax.tree.map(lambda x, h: h.astype(jnp.float32) if x.ndim >= 2 else x, params, held)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 48)), jnp.int32)
  logits = lambda p: model.apply(as_variables(inference_variables(p, moe_state)), tokens)[0]
  np.testing.assert_array_equal(logits(held), logits(rounded))
  greedy = lambda p: generate(
    model, inference_variables(p, moe_state), tokens[:, :8], max_new_tokens=6, temperature=0.0
  )
  np.testing.assert_array_equal(greedy(held), greedy(rounded))


MODEL_CASES = {
  'rope_gqa_tied': dict(),
  'rope_mha_untied': dict(num_kv_heads=0, attention_kind='mha', tie_embeddings=False),
  'nope_gqa_tied': dict(position='nope'),
  'rope_mqa_1layer': dict(num_layers=1, num_kv_heads=1, rope_theta=100.0),
}


@pytest.mark.parametrize('overrides', MODEL_CASES.values(), ids=MODEL_CASES.keys())
def test_forward_matches_numpy_reference(overrides):
  cfg = tiny_model_config(**overrides)
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  logits, aux = forward(cfg, params, tokens)
  ref_logits, ref_max = np_forward(cfg, params, tokens)
  assert logits.shape == (B, T, cfg.vocab_size) and logits.dtype == jnp.float32
  assert rel_err(logits, ref_logits) <= 1e-5
  assert list(aux['max_logits']) == [f'layer_{i}' for i in range(cfg.num_layers)]
  got_max = np.stack([aux['max_logits'][f'layer_{i}'] for i in range(cfg.num_layers)])
  assert got_max.shape == (cfg.num_layers, cfg.num_heads) and got_max.dtype == np.float32
  np.testing.assert_allclose(got_max, ref_max, rtol=1e-5, atol=1e-5)
  # The reference is sensitive to the rotation: toggling it in NumPy changes the answer.
  other = cfg.copy_and_resolve_references()
  other.position = 'nope' if cfg.position == 'rope' else 'rope'
  assert rel_err(logits, np_forward(other, params, tokens)[0]) > 1e-2


def test_one_token_forward_matches_numpy_reference():
  """At one token per sequence the layers project without stacking their weights
  (kimijax.layers.params.project): the MHA and SwiGLU matmuls of that path against float64."""
  cfg = tiny_model_config(num_kv_heads=0, attention_kind='mha')
  params = init_params(cfg)
  tokens = random_tokens(cfg, t=1)
  logits, _ = forward(cfg, params, tokens)
  assert logits.shape == (B, 1, cfg.vocab_size)
  assert rel_err(logits, np_forward(cfg, params, tokens)[0]) <= 1e-5


def test_rope_model_is_invariant_to_shifting_all_positions():
  cfg = tiny_model_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  base, _ = forward(cfg, params, tokens, positions)
  shifted, _ = forward(cfg, params, tokens, positions + 23)
  assert rel_err(shifted, np.asarray(base, np.float64)) <= 1e-4
  ref_shifted, _ = np_forward(cfg, params, tokens, positions + 23)
  assert rel_err(shifted, ref_shifted) <= 1e-5


def test_nope_ignores_positions():
  cfg = tiny_model_config(position='nope')
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  base, _ = forward(cfg, params, tokens)
  moved, _ = forward(cfg, params, tokens, jnp.broadcast_to(jnp.arange(T)[::-1] * 7, (B, T)))
  np.testing.assert_array_equal(moved, base)


def test_causality():
  cfg = tiny_model_config()
  params = init_params(cfg)
  tokens = random_tokens(cfg)
  base, _ = forward(cfg, params, tokens)
  for t in (0, 4, T - 1):
    changed = tokens.at[:, t].set((tokens[:, t] + 5) % cfg.vocab_size)
    logits, _ = forward(cfg, params, changed)
    np.testing.assert_allclose(logits[:, :t], base[:, :t], rtol=0, atol=1e-6)
    assert np.max(np.abs(logits[:, t] - base[:, t])) > 1e-2


def test_gqa_param_shapes():
  cfg = tiny_model_config()  # D=32, H=4, Hkv=2, Dh=8, F=48, V=37
  params = init_params(cfg)
  attn = params['layer_0']['attention']
  assert attn['query'].shape == (32, 4, 8)
  assert attn['key'].shape == (32, 2, 8)
  assert attn['value'].shape == (32, 2, 8)
  assert attn['out'].shape == (4, 8, 32)
  mlp = params['layer_1']['mlp']
  assert (matrix(mlp['wi_gate']).shape, matrix(mlp['wi_up']).shape, matrix(mlp['wo']).shape) == (
    (32, 48),
    (32, 48),
    (48, 32),
  )
  assert params['embed'].shape == (37, 32) and 'head' not in params
  untied = init_params(tiny_model_config(tie_embeddings=False))
  assert untied['head'].shape == (32, 37)


# ----------------------------------------------------------------------------- precision and remat


def test_bfloat16_compute_keeps_float32_params_and_logits():
  cfg16 = tiny_model_config(compute_dtype='bfloat16')
  cfg32 = tiny_model_config()
  tokens = random_tokens(cfg32, b=4, t=16)
  boxed = jax.eval_shape(Transformer(cfg16).init, jax.random.key(0), tokens)['params']
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nn.unbox(boxed)))
  params = init_params(cfg32)  # the same pytree serves both configs
  logits16, aux16 = forward(cfg16, params, tokens)
  logits32, _ = forward(cfg32, params, tokens)
  assert logits16.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in aux16['max_logits'].values())
  loss16, loss32 = float(cross_entropy(logits16, tokens)), float(cross_entropy(logits32, tokens))
  assert abs(loss16 - loss32) <= 2e-2 * loss32, (loss16, loss32)
  assert rel_err(logits16, np.asarray(logits32, np.float64)) <= 5e-2


def test_remat_gives_same_loss_and_gradients():
  tokens = random_tokens(tiny_model_config(), b=2, t=12)
  params = init_params(tiny_model_config())
  results = []
  for remat in (False, True):
    cfg = tiny_model_config(remat=remat)
    loss_fn = lambda p: cross_entropy(Transformer(cfg).apply({'params': p}, tokens)[0], tokens)
    results.append(jax.jit(jax.value_and_grad(loss_fn))(params))
  (loss0, grads0), (loss1, grads1) = results
  np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
  flat0, flat1 = jax.tree.leaves_with_path(grads0), jax.tree.leaves_with_path(grads1)
  assert [p for p, _ in flat0] == [p for p, _ in flat1]
  for (path, g0), (_, g1) in zip(flat0, flat1):
    assert np.max(np.abs(g0)) > 0, jax.tree_util.keystr(path)
    # Recomputation may fuse differently: allow float32 rounding relative to the leaf's scale.
    assert rel_err(g1, np.asarray(g0, np.float64)) <= 1e-5, jax.tree_util.keystr(path)


# ----------------------------------------------------------------------------- parameter count


def closed_form_param_count(m):
  v, d, f, h, layers = m.vocab_size, m.d_model, m.mlp_dim, m.num_heads, m.num_layers
  hkv, dh = (m.num_kv_heads or h), d // h
  attention = d * h * dh + 2 * d * hkv * dh + h * dh * d  # query, key + value, out
  per_layer = attention + 2 * d + 3 * d * f  # + two norm gains + SwiGLU matrices
  head = 0 if m.tie_embeddings else d * v
  return v * d + layers * per_layer + d + head  # embed, layers, final norm, head


@pytest.mark.parametrize(
  'overrides', [{}, dict(num_kv_heads=2, attention_kind='gqa', tie_embeddings=False)], ids=['default', 'gqa_untied']
)
def test_param_count_matches_closed_form(overrides):
  c = config_lib.base_config()
  c.model.update(overrides)
  m = config_lib.validate(c).model
  shapes = jax.eval_shape(Transformer(m).init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params']
  expected = closed_form_param_count(m)
  if not overrides:  # the default config, written out: 258*256 + 4*(4*256*256 + 2*256 + 3*256*768) + 256
    assert expected == 258 * 256 + 4 * (4 * 256 * 256 + 2 * 256 + 3 * 256 * 768) + 256 == 3_476_224
  assert count_params(shapes) == expected
  assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nn.unbox(shapes))) == expected


# ----------------------------------------------------------------------------- kernel settings


def test_kernel_settings_from_the_config_reach_the_layers_and_bad_ones_name_the_key():
  """model.kernels: 'key=int/key=int' over each kernel family's measured defaults ('' the
  defaults), parsed once into frozen settings that the model hands to the KDA layers, their short
  convs, the AttnRes residual, the MLA decode kernel and the MoE kernels; an unknown key or a bad
  value is one ConfigError naming the config key, before anything is built."""
  from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings
  from kernels_pallas.kda.settings import KdaSettings
  from kernels_pallas.mla_decode.settings import MlaDecodeSettings
  from kernels_pallas.short_conv.settings import ShortConvSettings
  from kimijax.layers import residual as residual_lib
  from kimijax.model import make_mixer
  from kimijax.ops.moe import BlockedSettings

  c = config_lib.base_config()
  c.model.update(layer_pattern='KA', residual='attnres_block')
  c.model.kernels.kda = 'warps_diag=4/flat_branch=0'
  c.model.kernels.attnres_phase1 = 'bt=32'
  m = config_lib.validate(c).model
  kernels = config_lib.kernel_settings(m)
  assert kernels == {
    'kda': KdaSettings(warps_diag=4, flat_branch=0),
    'short_conv': ShortConvSettings(),
    'attnres_phase1': Phase1Settings(bt=32),
    'attnres_merge_norm': MergeNormSettings(),
    'mla_decode': MlaDecodeSettings(),
    'moe': BlockedSettings(),  # model.moe.impl='xla_blocked''s block size
  }
  mixer = make_mixer(m, 'K', jnp.float32, kernels=kernels)
  assert mixer.settings == KdaSettings(warps_diag=4, flat_branch=0) and mixer.short_conv_settings == ShortConvSettings()
  residual = residual_lib.make_residual(m, kernels=kernels)
  assert residual.phase1_settings == Phase1Settings(bt=32) and residual.merge_norm_settings == MergeNormSettings()
  for key, text, says in [
    ('kda', 'warps_dig=2', r"unknown keys \['warps_dig'\]"),
    ('short_conv', 'rows=0', 'rows must be a positive int'),
    ('attnres_phase1', 'bt_grads=48', r'bt_grads \(48\) must divide rows_grads'),
    ('attnres_merge_norm', 'groups', "expected 'key=int/key=int'"),
  ]:
    c = config_lib.base_config()
    c.model.kernels[key] = text
    with pytest.raises(config_lib.ConfigError, match=rf"model.kernels.{key}='{text}': .*{says}"):
      config_lib.validate(c)


# ----------------------------------------------------------------------------- packed documents


def _packed_rows():
  """Two rows of T = 40, documents of 8, 8 and 24 tokens, and of 24 and 16 (three distinct lengths,
  so that running each alone compiles three programs): (segment_ids, positions)."""
  lengths = [[8, 8, 24], [24, 16]]
  ids = np.stack([np.repeat(np.arange(1, len(r) + 1), r) for r in lengths]).astype(np.int32)
  positions = np.stack([np.concatenate([np.arange(n) for n in r]) for r in lengths]).astype(np.int32)
  return ids, positions


@pytest.mark.parametrize(
  'overrides',
  [
    # ~70 s: KDA's chunk form on packed documents is also tested op by op in tests/ops/test_segments.py
    pytest.param(dict(attention_kind='gqa'), marks=pytest.mark.long),
    # the recurrence (the reference KDA) compiles faster than the chunk form, tested in 'gqa'
    dict(attention_kind='mla', num_kv_heads=0, mla_qk_rope_head_dim=8, mla_kv_lora_rank=16, kda_impl='xla_recurrent'),
    pytest.param(dict(attention_kind='gqa', kda_impl='pallas', short_conv_impl='pallas'), marks=pytest.mark.long),
  ],
  ids=['gqa', 'mla_rope', 'pallas_kernels'],
)
def test_packed_documents_give_each_document_alone(overrides):
  """A tiny hybrid (KDA with its short convs, then attention with RoPE) on rows of packed documents
  with their segment ids and restarting positions: the logits and the parameters' gradients are,
  token for token, those of running each document alone (a row of its own, positions from 0)."""
  from oracles import np_document_spans

  cfg = tiny_model_config(**{'layer_pattern': 'KA', 'kda_head_dim': 16, **overrides})
  params = init_params(cfg)
  model = Transformer(cfg, max_logits=False)
  ids, positions = _packed_rows()
  tokens = random_tokens(cfg, b=2, t=40)
  w = jnp.asarray(np.random.default_rng(3).standard_normal((2, 40, cfg.vocab_size)), jnp.float32)

  def loss(p, tokens, w, positions=None, ids=None):
    logits, _ = model.apply({'params': p}, tokens, positions, segment_ids_bt=ids)
    return jnp.sum(logits * w), logits

  run = jax.jit(jax.value_and_grad(loss, has_aux=True))  # one compile per shape
  (_, logits), grads = run(params, tokens, w, positions, ids)
  grads_alone = jax.tree.map(jnp.zeros_like, grads)
  for row, a, b in np_document_spans(ids):
    (_, piece), g = run(params, tokens[row : row + 1, a:b], w[row : row + 1, a:b])
    grads_alone = jax.tree.map(jnp.add, grads_alone, g)
    scale = float(jnp.max(jnp.abs(piece)))
    np.testing.assert_allclose(logits[row, a:b], piece[0], rtol=1e-5, atol=2e-5 * scale, err_msg=f'{row} [{a}, {b})')
  for (path, g), g_alone in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads_alone)):
    scale = float(jnp.max(jnp.abs(g_alone)))
    np.testing.assert_allclose(g, g_alone, rtol=1e-4, atol=1e-4 * scale, err_msg=jax.tree_util.keystr(path))


def test_positions_default_to_each_documents_own():
  """Without positions, a call with segment ids counts positions from each document's first token."""
  cfg = tiny_model_config()
  params = init_params(cfg)
  ids, positions = _packed_rows()
  tokens = random_tokens(cfg, b=2, t=40)
  run = jax.jit(lambda p, positions: Transformer(cfg).apply({'params': p}, tokens, positions, segment_ids_bt=ids)[0])
  np.testing.assert_array_equal(run(params, None), run(params, positions))


def test_document_inputs_of_a_batch():
  from kimijax.model import document_inputs

  ids, positions = _packed_rows()
  assert document_inputs({'inputs': ids}) == {}
  got = document_inputs({'inputs': ids, 'segment_ids': ids, 'positions': positions})
  assert got['segment_ids_bt'] is ids and got['positions_bt'] is positions
