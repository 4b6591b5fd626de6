"""kimijax: a JAX/Flax research codebase for Kimi Delta Attention, Attention Residuals and MuonClip.

As a library (README.md's example runs as tests/test_readme.py):

    config = kimijax.config.load('configs/default.py', overrides={'model.num_layers': 2})
    model = kimijax.model.Transformer(config.model)
    params = kimijax.init_params(config, jax.random.key(0))   # plain float32 arrays
    logits_btv, aux = model.apply({'params': params}, tokens_bt)

and any optax optimizer, kimijax.optim's muon and qk_clip included, takes `params` as they are.
"""

from __future__ import annotations


def init_params(config, rng):
  """Fresh parameters of Transformer(config.model) (or of a model config itself) from `rng`: a
  nested dict of plain float32 jax.Arrays, without the logical-axis boxes that `model.init`
  returns (nn.unbox), ready for model.apply({'params': params}, ...) and any optax optimizer.
  Built with the implementations that run on any machine (kimijax.config.portable), which have the
  same parameters, so a GPU config initialises on a CPU too. A model with MoE layers also takes its
  balancing biases, the 'moe_state' collection (zeros at the start; kimijax.model.variables and
  docs/moe.md)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp

  from kimijax import config as config_lib
  from kimijax.model import Transformer

  model_config = config.model if 'model' in config else config
  model = Transformer(config_lib.portable(model_config))
  tokens = jnp.zeros((1, 8), jnp.int32)
  return jax.jit(lambda key: nn.unbox(model.init(key, tokens)['params']))(rng)
