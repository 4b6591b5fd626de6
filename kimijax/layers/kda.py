"""Kimi Delta Attention layer (docs/kda.md): projections, short convolutions, gates and output.

    q, k = L2Norm(SiLU(ShortConv(W_q x))), L2Norm(SiLU(ShortConv(W_k x)));  v = SiLU(ShortConv(W_v x))
    beta = sigmoid(W_b x)                                  one scalar per head
    g = -exp(A_log) * softplus(W_f2 W_f1 x + dt_bias)      per-channel log-decay (<= 0), float32
        or lower_bound * sigmoid(exp(A_log) * (W_f2 W_f1 x + dt_bias)) with a bounded gate
    o = kda(q, k, v, g, beta)                              the delta-rule recurrence, kimijax.ops.kda
                                                           (which forms g from its pre-activation)
    y = W_o (RMSNorm_per_head(o) * sigmoid(W_g2 W_g1 x))   output gate: sigmoid | swish | none;
                                                           the norm's eps is output_norm_eps

Decode cache per sequence: the last 3 conv inputs of q, k and v, and the float32 state [H, K, V].
With segment_ids [B, T] (packed documents, data.document_mask; training only) the state starts
from zero at each document's first token and the short convolutions read no input of another
document (kimijax/ops/segments.py).

Memory: the q/k/v projections, the short convolutions and activations, beta, the decay gate and
the op run as one rematerialised region that keeps only the layer input, what the op names worth
keeping (kimijax.ops.kda.SAVED: the fused kernels' aqk and T, the chunk form's per-chunk states)
and the outputs of the projections not named in recompute_projections (checkpoint names
PROJECTIONS + '_q', '_k', '_v'). The op's inputs (q, k,
v after their activations, the gate's pre-activation) are recomputed in the backward pass; the op's forward
kernels, whose outputs the backward does not need, are not rerun. The output norm and gate are
recomputed too, so a training step keeps the layer input, the q/k/v projections (or not), the
op's output and named residuals, and the output gate's rank-sized bottleneck of a KDA layer.
Each projection recomputed is 2 bytes per token and channel less in bf16 (configs/bench_350m.py's
hybrid: 2.2 GiB over 18 layers) for one more [D, H*K] matmul in the backward.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from kimijax.layers.norms import rms_normalise
from kimijax.layers.params import weight
from kimijax.layers.short_conv import ShortConv
from kimijax.ops.kda import ACTIVATIONS, SAVED, kda, kda_decode
from kimijax.ops.short_conv import activate

CONV_WIDTH = 4
PROJECTIONS = 'kda_projection'  # checkpoint_name prefix of the q/k/v projections' outputs ('_q', ...)


def a_log_init(key, shape, dtype):
  """A_log = log(A), A ~ U(1, 16)."""
  return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


def dt_bias_init(key, shape, dtype):
  """Inverse softplus of dt ~ logU(1e-3, 1e-1) (floored at 1e-4)."""
  dt = jnp.exp(jax.random.uniform(key, shape, dtype, math.log(1e-3), math.log(1e-1)))
  dt = jnp.maximum(dt, 1e-4)
  return dt + jnp.log(-jnp.expm1(-dt))


class KimiDeltaAttention(nn.Module):
  """x [B, T, D] -> (y [B, T, D], None, cache or None). Heads H of key dim K and value dim V."""

  num_heads: int
  head_dim: int
  impl: str = 'xla'  # the op's implementation (kimijax.ops.kda.IMPLS)
  short_conv: bool = True
  output_gate: str = 'sigmoid'
  gate_lower_bound: float = 0.0  # 0: the unbounded gate; in [-5, 0): the bounded gate
  init_std: float = 0.02
  dtype: jnp.dtype = jnp.float32
  output_norm_eps: float = 1e-5  # eps of the per-head output RMSNorm (the model's rms_norm_eps
  # in Kimi Linear's release)
  short_conv_impl: str = 'xla'  # the short convs' implementation (kimijax.ops.short_conv.IMPLS)
  recompute_projections: str = ''  # the projections among 'q', 'k', 'v' that the backward
  # recomputes from the layer input instead of keeping (one bf16
  # [B, T, H, K] less each); '' keeps all three
  settings: Any = None  # the op's kernel settings under impl (None: the defaults)
  short_conv_settings: Any = None  # the short convs' kernel settings under short_conv_impl

  def _low_rank_weights(self, name, d, rank):
    """The two factors of a rank-`rank` projection [D] -> [H, K]."""
    return (
      weight(self, f'{name}_a', (d, rank), ('embed', 'latent')),
      weight(self, f'{name}_b', (rank, self.num_heads, self.head_dim), ('latent', 'heads', 'head_dim')),
    )

  def _gated_output(self, o_bthv, gain, g_btr, g_b, w_o):
    """W_o (RMSNorm_per_head(o) * gain * act(W_g2 g_lat)), the norm and gate in float32 (g_btr, the
    gate's rank-sized bottleneck, None: no output gate), the matmuls in self.dtype."""
    o_bthv = rms_normalise(o_bthv, self.output_norm_eps) * gain
    if g_btr is not None:
      gate_bthv = jnp.einsum('btr,rhk->bthk', g_btr, g_b).astype(jnp.float32)
      o_bthv = o_bthv * (jax.nn.sigmoid(gate_bthv) if self.output_gate == 'sigmoid' else jax.nn.silu(gate_bthv))
    o_bthv = nn.with_logical_constraint(o_bthv.astype(self.dtype), ('act_batch', 'act_length', 'act_heads', None))
    return jnp.einsum('bthk,hkd->btd', o_bthv, w_o)

  def _mix(self, x_btd, w_qkv, cache, segment_ids_bt=None):
    """From the layer input and the q/k/v projection weights: the projections (tagged PROJECTIONS),
    the short convolutions and activations, beta, the decay gate and the op, (o, new cache). The
    parameters are created in the order of the layer's definition (docs/kda.md), which fixes their
    initial values for a given seed. A decode step (one token, a cache) hands everything after the
    projections to kda_decode, one kernel under impl='pallas'."""
    projections = tuple(
      checkpoint_name(jnp.einsum('btd,dhk->bthk', x_btd, w), f'{PROJECTIONS}_{n}') for n, w in zip('qkv', w_qkv)
    )
    h, hd = self.num_heads, self.head_dim
    d = x_btd.shape[-1]
    convs = {
      name: ShortConv(
        width=CONV_WIDTH,
        dtype=self.dtype,
        activation=ACTIVATIONS[name],
        impl=self.short_conv_impl,
        settings=self.short_conv_settings,
        name=f'{name}_conv',
      )
      for name in ('qkv' if self.short_conv else '')
    }
    decode = cache is not None and x_btd.shape[1] == 1  # one token, O(1) in the context length
    new_cache, outs = {}, []
    for name, x_bthk in zip('qkv', projections):
      if decode:  # kda_decode runs the conv and activation
        outs.append(x_bthk[:, 0])
        continue
      if self.short_conv:
        prefix = None if cache is None else cache[f'conv_{name}']
        x_bthk, new_cache[f'conv_{name}'] = convs[name](x_bthk, prefix, segment_ids_bt)
      else:
        x_bthk = activate(x_bthk, ACTIVATIONS[name])
      outs.append(nn.with_logical_constraint(x_bthk.astype(self.dtype), ('act_batch', 'act_length', 'act_heads', None)))
    beta_bth = jnp.einsum('btd,dh->bth', x_btd, weight(self, 'b_proj', (d, h), ('embed', 'heads')))
    a_log = self.param('A_log', nn.with_logical_partitioning(a_log_init, ('heads',)), (h,), jnp.float32)
    dt_bias = self.param(
      'dt_bias', nn.with_logical_partitioning(dt_bias_init, ('heads', 'head_dim')), (h, hd), jnp.float32
    )
    f_a, f_b = self._low_rank_weights('f', d, hd)
    # The decay gate's pre-activation in self.dtype; the op forms the float32 log-decay from it
    # (inside the Pallas kernels under impl='pallas').
    f_bthk = jnp.einsum('btr,rhk->bthk', jnp.einsum('btd,dr->btr', x_btd, f_a), f_b)
    gate = dict(a_log=a_log, dt_bias=dt_bias, gate_lower_bound=self.gate_lower_bound)
    op = dict(impl=self.impl, settings=self.settings)

    if decode:
      conv = {}
      if self.short_conv:
        prefixes = tuple(cache[f'conv_{n}'] for n in 'qkv')
        conv = dict(prefixes=prefixes, taps=tuple(convs[n].taps(x.shape[1:]) for n, x in zip('qkv', outs)))
      o_bhv, new_cache['state'], new_prefixes = kda_decode(
        *outs, f_bthk[:, 0], beta_bth[:, 0], cache['state'], **gate, **conv, **op
      )
      new_cache.update({f'conv_{n}': p for n, p in zip('qkv', new_prefixes or ())})
      return o_bhv[:, None], new_cache
    q_bthk, k_bthk, v_bthv = outs
    beta_bth = jax.nn.sigmoid(beta_bth.astype(jnp.float32))
    if cache is None:
      o_bthv, _ = kda(q_bthk, k_bthk, v_bthv, f_bthk, beta_bth, **op, **gate, segment_ids=segment_ids_bt)
    else:  # prefill (or a chunk of it) from the cached state
      o_bthv, new_cache['state'] = kda(
        q_bthk, k_bthk, v_bthv, f_bthk, beta_bth, initial_state=cache['state'], output_final_state=True, **op, **gate
      )
    return o_bthv, new_cache

  @nn.compact
  def __call__(self, x_btd, positions_bt=None, cache=None, segment_ids_bt=None):
    del positions_bt  # KDA has no positional encoding: the decay orders the sequence
    h, hd = self.num_heads, self.head_dim
    d = x_btd.shape[-1]
    x_btd = x_btd.astype(self.dtype)
    names = ('embed', 'heads', 'head_dim')
    w_qkv = [weight(self, f'{n}_proj', (d, h, hd), names) for n in ('q', 'k', 'v')]
    kept = (SAVED,) + tuple(f'{PROJECTIONS}_{n}' for n in 'qkv' if n not in self.recompute_projections)
    mix = nn.remat(type(self)._mix, policy=jax.checkpoint_policies.save_only_these_names(*kept), prevent_cse=True)
    o_bthv, new_cache = mix(self, x_btd, w_qkv, cache, segment_ids_bt)

    gain = self.param('o_norm', nn.with_logical_partitioning(nn.initializers.ones, ('head_dim',)), (hd,), jnp.float32)
    g_btr = g_b = None
    if self.output_gate != 'none':
      g_a, g_b = self._low_rank_weights('g', d, hd)
      g_btr = jnp.einsum('btd,dr->btr', x_btd, g_a)
    w_o = weight(self, 'o_proj', (h, hd, d), ('heads', 'head_dim', 'embed'))
    y_btd = jax.checkpoint(self._gated_output)(o_bthv, gain, g_btr, g_b, w_o)
    return y_btd, None, (new_cache if cache is not None else None)

  @staticmethod
  def init_cache(batch: int, num_heads: int, head_dim: int, short_conv: bool, dtype) -> dict:
    cache = {'state': jnp.zeros((batch, num_heads, head_dim, head_dim), jnp.float32)}
    if short_conv:
      for name in ('q', 'k', 'v'):
        cache[f'conv_{name}'] = jnp.zeros((batch, CONV_WIDTH - 1, num_heads, head_dim), dtype)
    return cache
