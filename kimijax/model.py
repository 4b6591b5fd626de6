"""Decoder-only language model: embed -> layers by model.layer_pattern -> final norm -> head.

Each layer is two pre-norm sublayers, a sequence mixer (the pattern letter: 'A' attention) and
a SwiGLU MLP, joined by the residual strategy `model.residual`.

    model = Transformer(config.model)
    params = model.init(rng, tokens_bt)['params']
    logits_btv, aux = model.apply({'params': params}, tokens_bt)

`aux['max_logits']` is {'layer_<i>': [H] fp32} for each attention layer: its per-head max
scaled logit over the batch (SPEC §3), for logging and QK-Clip.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib
from kimijax.layers.attention import SelfAttention
from kimijax.layers.mlp import SwiGLU
from kimijax.layers.norms import RMSNorm

ACT_BTD = ('act_batch', 'act_length', 'act_embed')


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def cotangent_in(x, dtype):
  """Identity whose cotangent is cast to `dtype`: the float32 logits' gradient then flows back
  through the head matmul in the compute dtype (bf16 GEMMs) instead of float32 GEMMs."""
  return x


def _cotangent_in_fwd(x, dtype):
  return x, None


def _cotangent_in_bwd(dtype, _, g):
  return (g.astype(dtype),)


cotangent_in.defvjp(_cotangent_in_fwd, _cotangent_in_bwd)


class Layer(nn.Module):
  """One layer: h += mixer(norm(h)); h += mlp(norm(h)). Returns (h, max logits [H] of an
  attention mixer, else None)."""
  cfg: ml_collections.ConfigDict
  kind: str

  @nn.compact
  def __call__(self, h_btd, positions_bt):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    norm = lambda name: RMSNorm(cfg.norm_eps, dtype, name=name)
    if self.kind == 'A':
      mixer = SelfAttention(cfg.num_heads, config_lib.num_kv_heads(cfg), cfg.position == 'rope',
                            cfg.rope_theta, cfg.attn_impl, cfg.init_std, dtype, name='attention')
    else:
      raise ValueError(f'unknown layer kind {self.kind!r}')
    y_btd, max_logits_h = mixer(norm('mixer_norm')(h_btd), positions_bt)
    h_btd = nn.with_logical_constraint(h_btd + y_btd.astype(h_btd.dtype), ACT_BTD)
    y_btd = SwiGLU(cfg.mlp_dim, cfg.init_std, dtype, name='mlp')(norm('mlp_norm')(h_btd))
    h_btd = nn.with_logical_constraint(h_btd + y_btd.astype(h_btd.dtype), ACT_BTD)
    return h_btd, max_logits_h


class Transformer(nn.Module):
  """tokens [B, T] int32 -> (logits [B, T, V] fp32, aux)."""
  cfg: ml_collections.ConfigDict

  @nn.compact
  def __call__(self, tokens_bt, positions_bt=None):
    cfg = self.cfg
    dtype = jnp.dtype(cfg.compute_dtype)
    if positions_bt is None:
      positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
    embed = self.param('embed', nn.with_logical_partitioning(
        nn.initializers.normal(cfg.init_std), ('vocab', 'embed')), (cfg.vocab_size, cfg.d_model), jnp.float32)
    # The residual stream is kept in residual_dtype (default float32); sublayers compute in `dtype`.
    h_btd = jnp.take(embed, tokens_bt, axis=0).astype(cfg.residual_dtype)
    h_btd = nn.with_logical_constraint(h_btd, ACT_BTD)

    layer_cls = nn.remat(Layer, prevent_cse=True) if cfg.remat else Layer
    max_logits = {}
    for i, kind in enumerate(config_lib.layer_kinds(cfg)):
      h_btd, m = layer_cls(cfg, kind, name=f'layer_{i}')(h_btd, positions_bt)
      if m is not None:
        max_logits[f'layer_{i}'] = m

    x_btd = RMSNorm(cfg.norm_eps, dtype, name='final_norm')(h_btd)
    if cfg.tie_embeddings:
      head_dv = embed.T
    else:
      head_dv = self.param('head', nn.with_logical_partitioning(
          nn.initializers.normal(cfg.init_std), ('embed', 'vocab')), (cfg.d_model, cfg.vocab_size), jnp.float32)
    logits_btv = jnp.einsum('btd,dv->btv', x_btd, head_dv.astype(dtype), preferred_element_type=jnp.float32)
    logits_btv = cotangent_in(logits_btv, dtype)
    logits_btv = nn.with_logical_constraint(logits_btv, ('act_batch', 'act_length', 'act_vocab'))
    aux = {'max_logits': max_logits}
    return logits_btv, aux


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))
