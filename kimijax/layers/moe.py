"""Mixture-of-Experts feed-forward block: a router, stacked routed experts and shared experts, as
DeepSeek-V3 (arXiv 2412.19437), Moonlight (arXiv 2502.16982), Kimi K2 and Kimi Linear (arXiv
2510.26692) release it (docs/moe.md):

    y = sum_{i in K_t} w_ti SwiGLU_i(x_t) + SwiGLU_shared(x_t)

with the routing of kimijax.ops.moe.route (router logits x W_r in float32, the per-expert bias for
choosing only) and the experts run dropless by kimijax.ops.moe.routed_experts.

Variables of `MoE` (drop-in for the dense SwiGLU: x [B, T, D] -> y [B, T, D] in the compute dtype):

    params      'router' [D, E] float32 ('embed', None); 'wi_gate', 'wi_up' [E, D, F] and 'wo'
                [E, F, D] ('expert', 'embed', 'mlp' / 'expert', 'mlp', 'embed'), one SwiGLU per
                expert stacked on the leading axis (Muon sees E matrices); 'shared' (num_shared > 0):
                a kimijax.layers.mlp.SwiGLU of width F * num_shared
    'moe_state' 'bias' [E] float32, zeros at init: the balancing bias, not a gradient parameter.
                It is read, never written, by the layer: the train state keeps it beside the params
                (checkpointed, outside the optimizer and its weight decay) and `update_moe_state`
                moves it after each step. Every apply passes it: {'params': ..., 'moe_state': ...}.
    'moe_stats' written only when the caller makes the collection mutable (the train step):
                'load' [E] float32 ((token, k) rows per expert over the global batch),
                'aux_loss' () float32 (the sequence-wise balance loss times aux_loss_alpha, to be
                added to the training loss; 0 when alpha is 0), 'router_entropy' () float32.

The 'moe_stats' of a model mirror its 'moe_state' module paths, so the step's helpers below work on
a whole model: `moe_aux_loss(stats)`, `update_moe_state(state, stats, rate=)`, `moe_metrics(state,
stats)`.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from kimijax.layers.mlp import SwiGLU
from kimijax.layers.params import weight
from kimijax.ops import moe as moe_ops
from kimijax.ops.per_shard import spec_axes

MOE_STATE = 'moe_state'  # the variable collection of the balancing biases
MOE_STATS = 'moe_stats'  # the collection the layer writes its router statistics into


def _replace(_, value):
  return value


class MoE(nn.Module, kw_only=True):
  """Routed + shared experts; x [B, T, D] -> [B, T, D] in `dtype` (module docstring).

  Attributes:
    num_experts, top_k, expert_hidden (F): routed experts, experts per token, their SwiGLU width.
    num_shared: shared experts (one SwiGLU of width F * num_shared; 0: none).
    score_func: 'sigmoid' (as released) or 'softmax'. renormalize: divide the chosen scores by
      their sum. scaling_factor: the routed scaling factor. n_group, topk_group: group-limited
      routing (1, 1: off). aux_loss_alpha: the sequence-wise balance loss weight (0: off).
    init_std: N(0, init_std) for every weight. dtype: the compute dtype. impl: the grouped
      matmul, a key of kimijax.ops.moe.IMPLS. settings: its settings ('pallas': a MoeSettings,
      'xla_blocked': a BlockedSettings; model.kernels.moe parsed; None: the defaults). remat:
      recompute the routed experts in the backward from their inputs (the tokens and the
      routing) instead of keeping their top_k copies of each token's rows (model.moe.remat).
  """

  num_experts: int
  top_k: int
  expert_hidden: int
  num_shared: int = 0
  score_func: str = 'sigmoid'
  renormalize: bool = True
  scaling_factor: float = 1.0
  n_group: int = 1
  topk_group: int = 1
  aux_loss_alpha: float = 0.0
  init_std: float = 0.02
  dtype: Any = jnp.float32
  impl: str = 'xla'
  settings: Any = None
  remat: bool = False

  @nn.compact
  def __call__(self, x_btd):
    if x_btd.ndim != 3:
      raise ValueError(f'MoE expects x [B, T, D], got shape {tuple(x_btd.shape)}')
    moe_ops.check_routing(
      num_experts=self.num_experts,
      top_k=self.top_k,
      n_group=self.n_group,
      topk_group=self.topk_group,
      score_func=self.score_func,
    )
    b, t, d = x_btd.shape
    e, f, k = self.num_experts, self.expert_hidden, self.top_k
    router_de = self.param(
      'router',
      nn.with_logical_partitioning(nn.initializers.normal(self.init_std), ('embed', None)),
      (d, e),
      jnp.float32,
    )
    w_gate_edf = weight(self, 'wi_gate', (e, d, f), ('expert', 'embed', 'mlp'))
    w_up_edf = weight(self, 'wi_up', (e, d, f), ('expert', 'embed', 'mlp'))
    w_down_efd = weight(self, 'wo', (e, f, d), ('expert', 'mlp', 'embed'))
    bias_e = self.variable(MOE_STATE, 'bias', jnp.zeros, (e,), jnp.float32).value

    x_td = x_btd.reshape(b * t, d)
    logits_te = moe_ops.router_logits(x_td, router_de)
    routing = moe_ops.route(
      logits_te,
      bias_e,
      top_k=k,
      score_func=self.score_func,
      n_group=self.n_group,
      topk_group=self.topk_group,
      renormalize=self.renormalize,
      scaling_factor=self.scaling_factor,
    )
    routed = functools.partial(moe_ops.routed_experts, impl=self.impl, token_axes=_token_axes(), settings=self.settings)
    if self.remat:  # keeps only the arguments: no [T * K, .] rows between the forward and the backward
      routed = jax.checkpoint(routed, prevent_cse=True)
    y_td = routed(x_td.astype(self.dtype), routing.weights_tk, routing.experts_tk, w_gate_edf, w_up_edf, w_down_efd)
    y_btd = y_td.reshape(b, t, d)
    if self.num_shared:
      shared = SwiGLU(hidden=f * self.num_shared, init_std=self.init_std, dtype=self.dtype, name='shared')
      y_btd = y_btd + shared(x_btd).astype(jnp.float32)

    if self.is_mutable_collection(MOE_STATS):
      stats = {
        'load': moe_ops.expert_load(routing.experts_tk, e),
        'aux_loss': moe_ops.sequence_balance_loss(
          routing.scores_te.reshape(b, t, e), routing.experts_tk.reshape(b, t, k), alpha=self.aux_loss_alpha
        ),
        'router_entropy': moe_ops.router_entropy(routing.scores_te),
      }
      for name, value in stats.items():
        self.sow(MOE_STATS, name, value, init_fn=lambda: 0.0, reduce_fn=_replace)
    return y_btd.astype(self.dtype)


def _token_axes():
  """The mesh axes of the activations' batch under the active logical axis rules ('act_batch'),
  or None without rules (routed_experts then splits tokens over every mesh axis but 'tensor')."""
  if not nn.get_logical_axis_rules():
    return None
  return spec_axes(nn.logical_to_mesh_axes(('act_batch',))[0])


# ----------------------------------------------------------------------------- the train step's helpers


def _flat(tree) -> dict:
  return traverse_util.flatten_dict(nn.unbox(tree)) if tree else {}


def moe_aux_loss(moe_stats) -> jax.Array:
  """The sum of every MoE layer's 'aux_loss' in a 'moe_stats' collection (0.0 without MoE layers):
  the term the train step adds to its loss."""
  losses = [v for path, v in _flat(moe_stats).items() if path[-1] == 'aux_loss']
  return sum(losses, jnp.zeros((), jnp.float32))


def update_moe_state(moe_state, moe_stats, *, rate: float = 1e-3, centred: bool = False) -> dict:
  """The 'moe_state' after a step: each layer's bias moved by kimijax.ops.moe.update_bias with the
  'load' that layer wrote into 'moe_stats' (same module path). The loads must cover the global
  batch (under jit they do: the layer counts over the whole, sharded, batch)."""
  flat_state, flat_stats = _flat(moe_state), _flat(moe_stats)
  new = {}
  for path, value in flat_state.items():
    if path[-1] != 'bias':
      new[path] = value
      continue
    load = flat_stats.get(path[:-1] + ('load',))
    if load is None:
      raise ValueError(
        f'update_moe_state: no load for the bias at {"/".join(path)} in moe_stats '
        f'(paths there: {sorted("/".join(p) for p in flat_stats)})'
      )
    new[path] = moe_ops.update_bias(value, load, rate=rate, centred=centred)
  return traverse_util.unflatten_dict(new)


def moe_metrics(moe_state, moe_stats) -> dict:
  """{layer path ('layer_3/mlp'): {load_max_over_mean, load_cv, bias_min, bias_max, bias_range,
  router_entropy, aux_loss}} for the metrics of each MoE layer."""
  flat_state, flat_stats = _flat(moe_state), _flat(moe_stats)
  out = {}
  for path, load in flat_stats.items():
    if path[-1] != 'load':
      continue
    layer = path[:-1]
    stats = moe_ops.router_stats(load, flat_state.get(layer + ('bias',)), flat_stats.get(layer + ('router_entropy',)))
    if layer + ('aux_loss',) in flat_stats:
      stats['aux_loss'] = flat_stats[layer + ('aux_loss',)]
    out['/'.join(layer)] = stats
  return out
