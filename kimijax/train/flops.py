"""Training FLOPs: the one count behind bench_train's MFU, the sweeps' and the ladders' compute axis.

Per token (forward + backward = 3 x forward, a matmul of n weights = 2n FLOPs forward):
  6 * N_matmul                       N_matmul: the active parameters, less the input embedding table
                                     when it is not tied to the head (a lookup, no matmul). Active: all
                                     parameters, less in each MoE layer the num_experts - top_k routed
                                     experts a token is not sent to (so the router D x E, top_k routed
                                     experts and the shared ones count, and dense layers whole; the
                                     routing's sort and combine are not counted). Norm gains and conv
                                     taps are counted too: they are < 1% at every size here.
  + sum over attention layers of 3 * T * H * (Dqk + Dv)
                                     causal attention, QK^T and PV over on average T/2 keys (T =
                                     train.seq_len); MHA/GQA: Dqk = Dv = d_model / num_heads, so
                                     6 * T * d_model per layer; MLA: Dqk = nope + rope head dims.
  + sum over KDA layers of 18 * H * K * V
                                     the recurrence's three state products per token (S^T k, the
                                     rank-1 update, S^T q; 2 K V each), times 3 for the backward.
Per step, Muon adds its Newton-Schulz matmuls: per matrix [A, B] with m = min(A, B), n = max(A, B),
ns_steps * (4 m^2 n + 2 m^3). AdamW's elementwise work and Attention Residuals' depth attention
(a few memory-bound [B, T, D] passes per sublayer) are not counted.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib


def abstract_params(config: ml_collections.ConfigDict):
  """The model's parameters as ShapeDtypeStructs (no memory, no compile). Traced with the XLA
  implementations, which have the same parameters, so that a GPU config counts on any machine."""
  return _abstract_params(config_lib.portable(config.model).to_json())


@functools.lru_cache(maxsize=64)
def _abstract_params(model_json: str):
  """Cached by the model config (a ladder asks once per rung and variant)."""
  import flax.linen as nn

  from kimijax.model import Transformer

  model = Transformer(ml_collections.ConfigDict(json.loads(model_json)))
  tokens = jnp.zeros((1, 8), jnp.int32)
  return nn.unbox(jax.eval_shape(lambda r: model.init(r, tokens)['params'], jax.random.key(0)))


def count(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))


def attention_head_dims(model: ml_collections.ConfigDict) -> tuple[int, int]:
  """(Dqk, Dv) per query head of the full-attention layers."""
  head_dim = model.d_model // model.num_heads
  if model.attention_kind == 'mla':
    nope, rope, v = config_lib.mla_dims(model)
    return nope + rope, v
  return head_dim, head_dim


def active_count(config: ml_collections.ConfigDict, n_params: int | None = None) -> int:
  """Active parameters of the config's model: its n_params (default: counted from the shapes) less
  the routed experts a token does not use (config_lib.moe_inactive_params; 0 for a dense model)."""
  n_params = count(abstract_params(config)) if n_params is None else n_params
  return n_params - config_lib.moe_inactive_params(config.model)


def model_flops_per_token(config: ml_collections.ConfigDict, n_params: int) -> float:
  """Training FLOPs per token of the model (forward + backward), see the module docstring.
  n_params: the model's total parameter count (MoE: the inactive experts are taken off here)."""
  m, seq_len = config.model, config.train.seq_len
  kinds = config_lib.layer_kinds(m)
  n_params = active_count(config, n_params)
  n_matmul = n_params if m.tie_embeddings else n_params - m.vocab_size * m.d_model
  dqk, dv = attention_head_dims(m)
  kda_heads, kda_dim = config_lib.kda_dims(m)
  return (
    6.0 * n_matmul
    + kinds.count('A') * 3.0 * seq_len * m.num_heads * (dqk + dv)
    + kinds.count('K') * 18.0 * kda_heads * kda_dim * kda_dim
  )


def newton_schulz_flops_per_step(config: ml_collections.ConfigDict, params) -> float:
  """Muon's Newton-Schulz FLOPs of one step over every Muon matrix (0 without Muon)."""
  from kimijax.optim import factory

  routing = factory.routing(config)
  if routing is None:
    return 0.0
  total = 0.0
  for leaf, route in zip(jax.tree.leaves(params), jax.tree.leaves(routing.routes(params))):
    if route.rule == 'muon':
      s, a, b = route.view.sizes(leaf.shape)
      m, n = min(a, b), max(a, b)
      total += s * config.optimizer.ns_steps * (4.0 * m * m * n + 2.0 * m**3)
  return total


def training_flops_per_step(config: ml_collections.ConfigDict, params=None) -> dict:
  """{'params', 'active_params', 'model', 'optimizer', 'total'}: parameter counts (total, and
  active: equal for a dense model) and FLOPs of one training step of train.batch_size x
  train.seq_len tokens. `params` (arrays or ShapeDtypeStructs) defaults to the config's model,
  built abstractly. Muon's Newton-Schulz runs on every expert's matrices, active or not."""
  params = abstract_params(config) if params is None else params
  n_params = count(params)
  tokens = config.train.batch_size * config.train.seq_len
  model = model_flops_per_token(config, n_params) * tokens
  optimizer = newton_schulz_flops_per_step(config, params)
  return {
    'params': n_params,
    'active_params': active_count(config, n_params),
    'model': model,
    'optimizer': optimizer,
    'total': model + optimizer,
  }
