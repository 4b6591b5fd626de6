"""Residual strategies: how each sublayer's input is formed from what came before it.

The model numbers its consumers 0 .. L (sublayer l = 0 .. L-1: layer i's mixer 2i and MLP 2i+1;
consumer L: the final aggregator before the final norm) and drives a strategy with three calls;
sublayers (attention, KDA, MLA, MLP) only ever see the normalised input x_btd it hands them:

    state = res.start(x_btd)                          token embedding -> residual state (a pytree)
    x_btd, h_btd, w, state = res.read(state, l, norm)  consumer l's input h, normalised by its
                                                      pre-norm `norm` (an RMSNorm module)
    state = res.write(state, y_btd, l)                add sublayer l's output

The strategy applies the norm so that it can fuse it with how h is formed; where it does, h_btd
is None, unless the strategy logs (`log=True`): then h is also formed on its own, outside the
gradient, for the per-sublayer statistics.

`start` must run inside the model's compact method: an AttnRes start creates every consumer's
parameters there, in a child 'attnres' holding, per consumer '<name>' ('layer_<i>_mixer',
'layer_<i>_mlp', 'final'), 'attnres_query' (w, init 0) and, with the key norm
(model.attnres_key_norm, the default), 'attnres_key_scale' (g, init 1), both [D] float32 and
replicated (logical axis 'norm'). Sublayer 0 sees only the embedding (its input is the embedding
itself, in every variant), so it has none: 2d parameters (d without the key norm) for each of the
other L - 1 sublayers and the final aggregator. `w` is the consumer's depth-attention weights
averaged over batch and tokens ([sources] float32) when the strategy logs (`log=True`), else None.

Variants (docs/attention_residuals.md's ablations; kimijax.ops.attnres's docstring has the maths): the AttnRes
strategies hand model.attnres_key_norm and model.attnres_depth_weights to every op call as
key_norm / depth_weights; the ops, not this module, decide what they change. Only the parameters
depend on them here: without the key norm there is no key gain.

  standard        state h; read -> Norm(h) (and h); write -> h + y (the usual pre-norm residual
                  stream).
  attnres_block   sources b_0 .. b_{n-1} (the embedding b_0, then the sums of the completed
                  blocks of S = model.attnres_block_size sublayers) and p, the partial sum of the
                  current block (absent right after a block closes); read -> depth attention over
                  [b_0 .. b_{n-1}, p]. At most N + 1 sources live, N = ceil(L / S); when S does
                  not divide L the last block holds the remaining L mod S sublayers. Computed in
                  two phases (kimijax.ops.attnres): the first read of a block runs phase 1 for all
                  of the block's consumers at once over the fixed block sums (model.attnres_impl:
                  'xla' or the fused 'pallas' kernels) and the state holds its S outputs until the
                  block closes; each read then merges its consumer's output with p and applies
                  the pre-norm in one op (phase 2, kimijax.ops.attnres.merge_norm; 'pallas' fuses
                  the two, h never written). With an implementation that adds in its merge
                  ('pallas') and without remat, the write leaves the sublayer output pending and
                  the next read's merge_norm adds it to p. Block 0's phase 1, over b_0 alone, is
                  b_0 and its logits.
  attnres_full    S = 1: every sublayer output is a source (docs/attention_residuals.md, Full AttnRes). With 'pallas'
                  each read is phase 1 for one consumer, a kernel set compiled per source count
                  (up to L + 1 sources, unrolled): slow to compile for deep models.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from kimijax import config as config_lib
from kimijax.ops import attnres as attnres_ops
from kimijax.ops.attnres import depth_attention_list, merge_norm, merge_partial, phase1

ACT_BTD = ('act_batch', 'act_length', 'act_embed')


def _constrain(x_btd):
  return nn.with_logical_constraint(x_btd, ACT_BTD)


class AttnResQuery(nn.Module):
  """One consumer's parameters: pseudo-query w [D] (zeros) and, with `key_gain`, the key-norm
  gain g [D] (ones). Returns the effective query w * g (the gain folded into the query; see
  kimijax.ops.attnres), or w without the key norm (no norm, so no gain)."""

  dim: int
  key_gain: bool = True

  @nn.compact
  def __call__(self):
    w = self.param(
      'attnres_query', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)), (self.dim,), jnp.float32
    )
    if not self.key_gain:
      return w
    g = self.param(
      'attnres_key_scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)), (self.dim,), jnp.float32
    )
    return w * g


def consumer_name(consumer: int, num_sublayers: int) -> str:
  """'layer_<i>_mixer' / 'layer_<i>_mlp' for sublayer 2i / 2i+1, 'final' for the aggregator."""
  if consumer == num_sublayers:
    return 'final'
  return f'layer_{consumer // 2}_{"mlp" if consumer % 2 else "mixer"}'


class AttnResQueries(nn.Module):
  """Every consumer's AttnResQuery -> [L + 1, D] effective queries (row 0, sublayer 0: zeros)."""

  num_sublayers: int
  dim: int
  key_gain: bool = True

  @nn.compact
  def __call__(self):
    rows = [jnp.zeros((self.dim,), jnp.float32)]
    rows += [
      AttnResQuery(dim=self.dim, key_gain=self.key_gain, name=consumer_name(l, self.num_sublayers))()
      for l in range(1, self.num_sublayers + 1)
    ]
    return jnp.stack(rows)


@dataclasses.dataclass(frozen=True)
class StandardResidual:
  """h_{l+1} = h_l + f_l(Norm(h_l)); the state is h [B, T, D] in the residual dtype."""

  log: bool = False

  def start(self, x_btd):
    return _constrain(x_btd)

  def read(self, h_btd, consumer: int, norm):
    del consumer
    return norm(h_btd), h_btd, None, h_btd

  def write(self, h_btd, y_btd, sublayer: int):
    del sublayer
    return _constrain(h_btd + y_btd.astype(h_btd.dtype))


@flax.struct.dataclass
class AttnResState:
  queries: Any  # [L + 1, D] float32: consumer l's effective query w_l * g_l
  blocks: tuple[Any, ...]  # b_0 (embedding), then one [B, T, D] sum per completed block
  partial: Any  # [B, T, D] sum of the current block so far, or None
  pending: Any  # [B, T, D] the last sublayer's output, still to be added to
  # `partial` (by the next read's kernel), or None
  inter: Any  # phase 1 of the current block: (S' outputs [B, T, D], lse [S', B, T]),
  # or None (no read in this block yet; block 0's first is sublayer 1's)


@dataclasses.dataclass(frozen=True)
class AttnResidual:
  """Block Attention Residuals with `block_size` sublayers per block (1: Full AttnRes) over
  `num_sublayers` sublayers; both phases by `impl` (a key of kimijax.ops.attnres.IMPLS, its kernels
  under phase1_settings and merge_norm_settings), with the variant `key_norm`, `depth_weights`
  (handed to every op call).
  defer_add: a write within a block leaves its output pending, and the next read's merge_norm
  adds it to the partial sum (for an implementation whose merge adds in the same pass, one pass
  fewer than a separate add; not under remat, where the pending output would be one more tensor
  in each layer's saved carry). A read that logs statistics (log=True) settles the pending output
  with an XLA add instead: the same sum."""

  block_size: int
  num_sublayers: int
  eps: float = 1e-6
  impl: str = 'xla'
  log: bool = False
  defer_add: bool = False
  key_norm: bool = True
  depth_weights: str = 'softmax'
  phase1_settings: Any = None
  merge_norm_settings: Any = None

  @property
  def variant(self) -> dict:
    """The variant's keyword arguments for the kimijax.ops.attnres calls."""
    return {'key_norm': self.key_norm, 'depth_weights': self.depth_weights}

  def start(self, x_btd):
    queries = AttnResQueries(
      num_sublayers=self.num_sublayers, dim=x_btd.shape[-1], key_gain=self.key_norm, name='attnres'
    )()
    return AttnResState(queries=queries, blocks=(_constrain(x_btd),), partial=None, pending=None, inter=None)

  @staticmethod
  def settle(state: AttnResState) -> AttnResState:
    """The state with its pending sublayer output added to the partial sum (by XLA)."""
    if state.pending is None:
      return state
    return state.replace(partial=_constrain(state.partial + state.pending), pending=None)

  @staticmethod
  def sources(state: AttnResState) -> tuple:
    """b_0 .. b_{n-1} and the partial sum, if any (of a settled state)."""
    assert state.pending is None, 'settle the state first'
    return state.blocks + (() if state.partial is None else (state.partial,))

  def read(self, state: AttnResState, consumer: int, norm):
    # A pending output is handed to merge_norm (which adds it in its own pass) unless the read
    # forms statistics, which need the settled partial sum.
    pending = None if self.log else state.pending
    state = self.settle(state) if pending is None else state.replace(pending=None)
    sources, query_d = self.sources(state), state.queries[consumer]
    w_n = self._mean_weights(sources, query_d) if self.log else None
    if len(sources) == 1:  # sublayer 0: the embedding alone, weight 1, no parameters
      return norm(sources[0]), sources[0], w_n, state
    start = consumer - consumer % self.block_size  # the block's first consumer
    spec = nn.logical_to_mesh_axes(ACT_BTD)  # the kernels' layout under a mesh
    if state.inter is None:  # the block's first read: phase 1 for all its consumers
      stop = min(start + self.block_size, self.num_sublayers + 1)
      outs, lse, blocks = phase1(
        state.blocks,
        state.queries[start:stop],
        eps=self.eps,
        impl=self.impl,
        spec=spec,
        settings=self.phase1_settings,
        **self.variant,
      )
      # Later blocks take the block sums from phase 1's output: with 'pallas' their gradient
      # is then summed inside its backward kernel.
      state = state.replace(blocks=blocks, inter=(outs, lse))
    outs, lse = state.inter
    o_btd, lse_bt = outs[consumer - start], lse[consumer - start]
    if state.partial is None:
      h_btd = _constrain(o_btd)
      return norm(h_btd), h_btd, w_n, state
    # Phase 2 and the pre-norm in one op ('pallas': fused, the merged input never written).
    x_btd, partial = merge_norm(
      o_btd,
      lse_bt,
      state.partial,
      query_d,
      norm.gain(o_btd.shape[-1]),
      eps=self.eps,
      norm_eps=norm.eps,
      dtype=norm.dtype,
      addend=pending,
      impl=self.impl,
      spec=spec,
      settings=self.merge_norm_settings,
      **self.variant,
    )
    h_btd = None
    if self.log:  # for the statistics only: training does not change with logging
      h_btd = jax.lax.stop_gradient(
        _constrain(merge_partial(o_btd, lse_bt, state.partial, query_d, eps=self.eps, **self.variant))
      )
    # The next partial sum takes p from merge_norm ('pallas' then adds its gradient in-kernel).
    return _constrain(x_btd), h_btd, w_n, state.replace(partial=partial)

  def _mean_weights(self, sources, query_d):
    """The depth-attention weights [sources] averaged over batch and tokens (for logging; with
    sigmoid weights a row need not sum to 1)."""
    if len(sources) == 1:
      return jnp.ones((1,), jnp.float32)
    alpha_nbt = depth_attention_list(sources, query_d, eps=self.eps, return_weights=True, **self.variant)[1]
    return jnp.mean(alpha_nbt, axis=tuple(range(1, alpha_nbt.ndim)))

  def write(self, state: AttnResState, y_btd, sublayer: int):
    y_btd = _constrain(y_btd.astype(state.blocks[0].dtype))
    state = self.settle(state)  # a safeguard: the model reads between writes, which settles
    closes = (sublayer + 1) % self.block_size == 0
    if self.defer_add and state.partial is not None and not closes:
      return state.replace(pending=y_btd)
    partial = _constrain(y_btd if state.partial is None else state.partial + y_btd)
    if closes:
      return state.replace(blocks=state.blocks + (partial,), partial=None, inter=None)
    return state.replace(partial=partial)


def num_sublayers(cfg: ml_collections.ConfigDict) -> int:
  return 2 * cfg.num_layers


def block_size(cfg: ml_collections.ConfigDict) -> int:
  """Sublayers per AttnRes block: 1 for attnres_full, model.attnres_block_size for attnres_block."""
  return 1 if cfg.residual == 'attnres_full' else cfg.attnres_block_size


def num_sources(cfg: ml_collections.ConfigDict) -> int:
  """Sources the final aggregator sees (the most any consumer sees): 1 + ceil(L / S) for AttnRes
  (L + 1 for Full), 1 for standard."""
  if cfg.residual == 'standard':
    return 1
  return 1 + -(-num_sublayers(cfg) // block_size(cfg))


def make_residual(cfg: ml_collections.ConfigDict, *, log: bool = False, kernels: dict | None = None):
  """The strategy named by model.residual; kernels: model.kernels parsed (config_lib.kernel_settings;
  None: parsed here)."""
  if cfg.residual == 'standard':
    return StandardResidual(log=log)
  if cfg.residual in ('attnres_full', 'attnres_block'):
    kernels = config_lib.kernel_settings(cfg) if kernels is None else kernels
    return AttnResidual(
      block_size=block_size(cfg),
      num_sublayers=num_sublayers(cfg),
      eps=cfg.norm_eps,
      impl=cfg.attnres_impl,
      log=log,
      defer_add=attnres_ops.IMPLS[cfg.attnres_impl].adds_in_merge and not cfg.remat,
      key_norm=cfg.attnres_key_norm,
      depth_weights=cfg.attnres_depth_weights,
      phase1_settings=kernels['attnres_phase1'],
      merge_norm_settings=kernels['attnres_merge_norm'],
    )
  raise ValueError(f'model.residual={cfg.residual!r} is unknown')


def rms(x) -> jax.Array:
  """Root mean square over every element, float32 scalar (for the per-sublayer analysis)."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x))
