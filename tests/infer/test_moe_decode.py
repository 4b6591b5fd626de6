"""Decoding an MoE model (model.mlp_kind='moe'): prefill + step-by-step decode logits equal the
full forward's, with non-zero balancing biases that change the experts chosen; greedy
generation from the inference variables follows the full forward's argmax."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax import config as config_lib
from kimijax.infer.cache import init_cache
from kimijax.infer.generate import generate
from kimijax.layers.moe import MOE_STATE
from kimijax.model import Transformer, inference_variables, variables

B, T, PROMPT = 2, 10, 4


def moe_mla():
  """Two MLA layers (NoPE, as Kimi Linear), a dense MLP then an MoE MLP of 8 experts, top-2, 1
  shared. (The MLP has no cache, whatever the mixer: KDA's decoding is tests/infer/test_hybrid.py's.)"""
  c = config_lib.base_config()
  c.model.update(
    d_model=32,
    num_layers=2,
    num_heads=4,
    mlp_dim=48,
    attention_kind='mla',
    position='nope',
    mla_kv_lora_rank=16,
    compute_dtype='float32',
    init_std=0.2,
    mlp_kind='moe',
  )
  c.model.moe.update(num_experts=8, top_k=2, num_shared=1, first_dense_layers=1, scaling_factor=2.446)
  return config_lib.validate(c).model


@pytest.fixture(scope='module')
def setup():
  cfg = moe_mla()
  model = Transformer(cfg)
  tokens = jax.random.randint(jax.random.key(3), (B, T), 0, cfg.vocab_size)
  v = nn.unbox(jax.jit(model.init)(jax.random.key(0), tokens))
  keys = iter(jax.random.split(jax.random.key(5), 2))
  moe_state = jax.tree.map(lambda b: 0.05 * jax.random.normal(next(keys), b.shape), v[MOE_STATE])
  return cfg, model, v['params'], moe_state, tokens


def test_prefill_and_decode_equal_full_forward(setup):
  cfg, model, params, moe_state, tokens = setup
  full = jax.jit(model.apply)(variables(params, moe_state), tokens)[0]
  # The biases matter: the full forward without them differs.
  unbiased = jax.jit(model.apply)(variables(params, jax.tree.map(jnp.zeros_like, moe_state)), tokens)[0]
  assert float(jnp.max(jnp.abs(unbiased - full))) > 1e-3

  @jax.jit
  def run(tokens_bt, positions_bt, cache):
    logits, aux = model.apply(variables(params, moe_state), tokens_bt, positions_bt, cache=cache)
    return logits, aux['cache']

  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  logits, cache = run(tokens[:, :PROMPT], positions[:, :PROMPT], init_cache(cfg, B, T))
  steps = [logits]
  for t in range(PROMPT, T):
    logits, cache = run(tokens[:, t : t + 1], positions[:, t : t + 1], cache)
    steps.append(logits)
  got = jnp.concatenate(steps, axis=1)
  np.testing.assert_allclose(got, full, rtol=1e-4, atol=1e-4 * float(jnp.abs(full).max()))


def test_greedy_generation_from_the_inference_variables(setup):
  cfg, model, params, moe_state, tokens = setup
  weights = inference_variables(params, moe_state)
  assert set(weights) == {'params', MOE_STATE}
  out = generate(model, weights, tokens[:, :PROMPT], max_new_tokens=3, temperature=0.0)
  forward = jax.jit(model.apply)
  for t in range(PROMPT, PROMPT + 3):  # each generated token is the argmax of the full forward on its prefix
    logits, _ = forward(variables(params, moe_state), jnp.asarray(out[:, :t]))
    np.testing.assert_array_equal(out[:, t], np.argmax(logits[:, -1], axis=-1))
