"""Residual strategies: how each sublayer's input is formed from what came before it.

The model numbers its sublayers 0 .. L-1 (layer i: mixer 2i, MLP 2i+1) and drives a strategy
with four calls; sublayers (attention, KDA, MLA, MLP) only ever see the h_btd it hands them:

    state = res.start(x_btd)              token embedding -> residual state (a pytree of [B, T, D])
    h_btd, w = res.read(state, 'mixer')   the next sublayer's input, before its own pre-norm
    state = res.write(state, y_btd, l)    add sublayer l's output
    h_btd, w = res.read(state, 'final')   after the last sublayer: the final norm's input

`read` must run inside a Flax module's compact method: an AttnRes read creates that consumer's
parameters there, in a child '<name>_attnres' with 'attnres_query' (w, init 0) and
'attnres_key_scale' (g, init 1), both [D] float32 and replicated (logical axis 'norm'). The very
first sublayer sees only the embedding (its softmax is over one source), so it has none: an
AttnRes model has 2d parameters for each of the other L - 1 sublayers and the final aggregator.
`w` is the consumer's depth-attention weights averaged over batch and tokens ([sources] float32)
when the strategy logs (`log=True`), else None.

  standard        state h; read -> h; write -> h + y (the usual pre-norm residual stream).
  attnres_full    state (v_0, v_1, ..., v_l): the embedding and every sublayer output so far;
                  read -> depth attention over all of them (SPEC §4, Full AttnRes).
  attnres_block   state (b_0, ..., b_{n-1}; p): the embedding b_0, the sums b_k of the completed
                  blocks of S = model.attnres_block_size sublayers, and the partial sum p of the
                  current block (absent right after a block closes); read -> depth attention over
                  [b_0 .. b_{n-1}, p]. At most N + 1 arrays live, N = ceil(L / S); when S does
                  not divide L the last block holds the remaining L mod S sublayers. S = 1 is
                  Full AttnRes exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import ml_collections

from kimijax.ops.attnres import depth_attention_list

ACT_BTD = ('act_batch', 'act_length', 'act_embed')


def _constrain(x_btd):
  return nn.with_logical_constraint(x_btd, ACT_BTD)


class AttnResQuery(nn.Module):
  """One consumer's parameters: pseudo-query w [D] (zeros) and key-norm gain g [D] (ones).
  Returns the effective query w * g (the gain folded into the query; see kimijax.ops.attnres)."""
  dim: int

  @nn.compact
  def __call__(self):
    w = self.param('attnres_query', nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)),
                   (self.dim,), jnp.float32)
    g = self.param('attnres_key_scale', nn.with_logical_partitioning(nn.initializers.ones, ('norm',)),
                   (self.dim,), jnp.float32)
    return w * g


@dataclasses.dataclass(frozen=True)
class StandardResidual:
  """h_{l+1} = h_l + f_l(Norm(h_l)); the state is h [B, T, D] in the residual dtype."""
  log: bool = False

  def start(self, x_btd):
    return _constrain(x_btd)

  def read(self, h_btd, name: str):
    del name
    return h_btd, None

  def write(self, h_btd, y_btd, sublayer: int):
    del sublayer
    return _constrain(h_btd + y_btd.astype(h_btd.dtype))


@flax.struct.dataclass
class AttnResState:
  blocks: tuple[Any, ...]    # b_0 (embedding), then one [B, T, D] sum per completed block
  partial: Any               # [B, T, D] sum of the current block so far, or None


@dataclasses.dataclass(frozen=True)
class AttnResidual:
  """Block Attention Residuals with `block_size` sublayers per block (1: Full AttnRes)."""
  block_size: int
  eps: float = 1e-6
  log: bool = False

  def start(self, x_btd):
    return AttnResState(blocks=(_constrain(x_btd),), partial=None)

  @staticmethod
  def sources(state: AttnResState) -> tuple:
    return state.blocks + (() if state.partial is None else (state.partial,))

  def read(self, state: AttnResState, name: str):
    sources = self.sources(state)
    if len(sources) == 1:        # the first sublayer: the embedding alone, weight 1, no parameters
      h_btd = sources[0]
      return h_btd, (jnp.ones((1,), jnp.float32) if self.log else None)
    query_d = AttnResQuery(sources[0].shape[-1], name=f'{name}_attnres')()
    h_btd, alpha_nbt = depth_attention_list(sources, query_d, eps=self.eps, return_weights=True)
    mean_n = jnp.mean(alpha_nbt, axis=tuple(range(1, alpha_nbt.ndim))) if self.log else None
    return _constrain(h_btd), mean_n

  def write(self, state: AttnResState, y_btd, sublayer: int):
    y_btd = y_btd.astype(state.blocks[0].dtype)
    partial = _constrain(y_btd if state.partial is None else state.partial + y_btd)
    if (sublayer + 1) % self.block_size == 0:      # sublayer closes its block
      return AttnResState(blocks=state.blocks + (partial,), partial=None)
    return AttnResState(blocks=state.blocks, partial=partial)


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


def make_residual(cfg: ml_collections.ConfigDict, *, log: bool = False):
  """The strategy named by model.residual."""
  if cfg.residual == 'standard':
    return StandardResidual(log=log)
  if cfg.residual in ('attnres_full', 'attnres_block'):
    return AttnResidual(block_size(cfg), eps=cfg.norm_eps, log=log)
  raise ValueError(f'model.residual={cfg.residual!r} is unknown')


def rms(x) -> jax.Array:
  """Root mean square over every element, float32 scalar (for the per-sublayer analysis)."""
  x = x.astype(jnp.float32)
  return jnp.sqrt(jnp.mean(x * x))
