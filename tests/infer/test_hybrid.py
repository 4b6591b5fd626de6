"""The hybrid model (KDA + MHA/GQA/MLA by model.layer_pattern): prefill + step-by-step decode
logits equal the full forward logits; generation; layer-pattern parsing and config errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.infer.cache import cache_bytes, init_cache
from kimijax.infer.generate import generate
from kimijax.infer.sampling import filter_logits
from kimijax.model import Transformer

B, T = 2, 12


def tiny(pattern, kind, **overrides):
  c = config_lib.base_config()
  m = c.model
  m.update(
    d_model=32,
    num_layers=4,
    num_heads=4,
    mlp_dim=48,
    layer_pattern=pattern,
    attention_kind=kind,
    compute_dtype='float32',
    init_std=0.2,
    mla_kv_lora_rank=16,
  )
  if kind == 'gqa':
    m.num_kv_heads = 2
  m.update(**overrides)
  config_lib.validate(c)
  return m


CASES = {
  '3:1 KDA:MLA nope': tiny('3:1', 'mla', position='nope'),
  'KA gqa rope': tiny('KA', 'gqa'),
  'all-attention mha': tiny('A', 'mha'),
  'all-KDA': tiny('K', 'mha'),
  'KA mla nope, fused KDA kernels': tiny('KA', 'mla', position='nope', num_heads=2, kda_impl='pallas'),
  'KKA mla rope qlora, attnres_block': tiny(
    'KKA', 'mla', mla_qk_rope_head_dim=4, mla_q_lora_rank=8, residual='attnres_block', attnres_block_size=2
  ),
}


def _model(cfg):
  model = Transformer(cfg)
  tokens = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)
  params = nn.unbox(model.init(jax.random.key(0), tokens)['params'])
  if cfg.residual != 'standard':  # distinct non-zero pseudo-queries: depth attention not uniform
    keys = iter(jax.random.split(jax.random.key(7), 4 * cfg.num_layers))
    params = jax.tree_util.tree_map_with_path(
      lambda p, x: jax.random.normal(next(keys), x.shape) if 'attnres_query' in jax.tree_util.keystr(p) else x, params
    )
  return model, params, tokens


LONG_CASES = ('3:1 KDA:MLA nope', 'KA mla nope, fused KDA kernels', 'KKA mla rope qlora, attnres_block', 'KA gqa rope')


@pytest.mark.parametrize(
  'cfg',
  [pytest.param(cfg, id=name, marks=[pytest.mark.long] if name in LONG_CASES else []) for name, cfg in CASES.items()],
)
def test_prefill_and_decode_equal_full_forward(cfg):
  model, params, tokens = _model(cfg)
  full, _ = model.apply({'params': params}, tokens)
  prompt = 5
  cache = init_cache(cfg, B, T)
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  logits, aux = model.apply({'params': params}, tokens[:, :prompt], positions[:, :prompt], cache=cache)
  steps = [logits]
  cache = aux['cache']
  for t in range(prompt, T):
    logits, aux = model.apply({'params': params}, tokens[:, t : t + 1], positions[:, t : t + 1], cache=cache)
    cache = aux['cache']
    steps.append(logits)
  got = jnp.concatenate(steps, axis=1)
  scale = float(jnp.abs(full).max())
  np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4 * scale)


def test_kda_cache_does_not_grow_with_context():
  cfg = CASES['3:1 KDA:MLA nope']
  short, long = init_cache(cfg, 1, 1024), init_cache(cfg, 1, 4096)
  assert cache_bytes(short['layer_0']) == cache_bytes(long['layer_0'])  # KDA: fixed state
  assert cache_bytes(long['layer_3']) == 4 * cache_bytes(short['layer_3'])  # MLA: per token
  assert long['layer_3']['latent'].shape == (1, 4096, cfg.mla_kv_lora_rank)


@pytest.mark.long
def test_greedy_generation_matches_argmax_of_full_forward():
  cfg = CASES['3:1 KDA:MLA nope']
  model, params, tokens = _model(cfg)
  out = generate(model, params, tokens[:, :4], max_new_tokens=6, temperature=0.0)
  assert out.shape == (B, 10)
  np.testing.assert_array_equal(out[:, :4], tokens[:, :4])
  for t in range(4, 10):  # each generated token is the argmax of the full forward on its prefix
    logits, _ = model.apply({'params': params}, jnp.asarray(out[:, :t]))
    np.testing.assert_array_equal(out[:, t], np.argmax(logits[:, -1], axis=-1))


def test_top_k_and_top_p_filtering():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  keep = lambda f: np.isfinite(np.asarray(f))[0].tolist()
  assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
  assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]  # 0.5 reached
  assert keep(filter_logits(logits, top_p=0.8)) == [True, True, False, False]
  assert keep(filter_logits(logits, top_p=0.81)) == [True, True, True, False]
  assert keep(filter_logits(logits, top_k=3, top_p=0.99)) == [True, True, True, False]


@pytest.mark.parametrize(
  'pattern,kinds',
  [('3:1', 'KKKAKKKA'), ('KKA', 'KKAKKAKK'), ('0:1', 'AAAAAAAA'), ('1:0', 'KKKKKKKK'), ('A', 'AAAAAAAA')],
)
def test_layer_pattern_expansion(pattern, kinds):
  cfg = config_lib.base_config().model
  cfg.num_layers, cfg.layer_pattern = 8, pattern
  assert config_lib.layer_kinds(cfg) == kinds


@pytest.mark.parametrize(
  'key,value,message',
  [
    ('layer_pattern', 'KXA', "unknown letter 'X'"),
    ('layer_pattern', '3:y', "a ratio must be 'K:A'"),
    ('attention_kind', 'mqa', "allowed values: ['mha', 'gqa', 'mla']"),
    ('kda_output_gate', 'relu', "model.kda_output_gate='relu' is not allowed"),
    ('kda_gate_lower_bound', -7.0, 'model.kda_gate_lower_bound'),
    ('mla_qk_rope_head_dim', 3, 'model.mla_qk_rope_head_dim=3 must be even'),
  ],
)
def test_config_errors_name_the_key(key, value, message):
  c = config_lib.base_config()
  c.model[key] = value
  with pytest.raises(config_lib.ConfigError, match=message.replace('[', r'\[').replace(']', r'\]')):
    config_lib.validate(c)
