"""Mixture-of-Experts ops: the released routing and a dropless grouped-matmul dispatch (docs/moe.md).

Routing (DeepSeek-V3 §2.1, arXiv 2412.19437; the routing Moonlight, arXiv 2502.16982, Kimi K2 and
Kimi Linear, arXiv 2510.26692, release), per token t with router logits u_t = x_t W_r [E] in float32:

    s_t = sigmoid(u_t)                       (score_func='sigmoid'; 'softmax': s_t = softmax(u_t))
    c_t = s_t + b                            b [E] float32, the per-expert bias: for choosing only
    with groups (n_group > 1): the E experts form n_group groups of E / n_group; a group's score
      is the sum of its two largest c_t; only the topk_group best groups are eligible
    K_t = the top_k eligible experts by c_t
    w_ti = s_ti / (sum_{j in K_t} s_tj + 1e-20) * scaling_factor   for i in K_t (renormalize=True;
      else s_ti * scaling_factor): the chosen experts' unbiased scores

Routed experts, dropless (every (token, k) pair reaches its expert: no capacity, no dropping):

    y_t = sum_{i in K_t} w_ti W_down_i^T (silu(W_gate_i^T x_t) * (W_up_i^T x_t))

with W_gate, W_up [E, D, F] and W_down [E, F, D] stacked. The T*K (token, k) rows are sorted by
expert (`sort_by_expert`: the order, its inverse and the rows per expert), the rows' inputs
gathered (`permute`), the experts' SwiGLU run as two grouped matmuls (`expert_swiglu`: gate and up
in one of width 2F, then down) through IMPLS[impl].ragged_dot, and the rows put back in token
order and summed over k with their weights in float32 (`combine`). `routed_experts` composes them
and, under a current mesh (jax.set_mesh, as the train step sets it), runs them per shard with the
experts split over the mesh axis 'expert' (expert parallelism; see there).

Balancing and statistics: `update_bias` (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2, and
Moonlight's centred variant), `sequence_balance_loss` (DeepSeek-V3's complementary sequence-wise
auxiliary loss), `expert_load`, `router_entropy`, `router_stats`.

Numerics: router logits, scores, the bias, the weights and the combine in float32; the expert
matmuls in the inputs' dtype (the compute dtype), accumulated in float32 by the implementations.

IMPLS, the grouped matmul (ragged dot) by name:

    'xla'      jax.lax.ragged_dot, the reference; runs everywhere, but this XLA lowers it on the GPU as
               a dense matmul over all groups (experiments/results/moe.md)
    'xla_blocked'  plain XLA: the rows of each group padded to whole blocks of b rows, then one
               batched matmul of the blocks against their group's matrix (one gathered per
               block); up to G b padding rows of work and (M / b + G) K N gathered weight values,
               b = the power of two nearest M / (4 G), at least 8 (4: BlockedSettings'
               blocks_per_group, model.kernels.moe). On XLA:CPU 5-9x faster than
               lax.ragged_dot at the CPU configs' shapes, as fast as a dense SwiGLU of the same
               active width (experiments/results/moe.md), and model.moe.impl's default; on
               Hopper GPUs 'mosaic' is faster (below).
               `routed_experts` runs the whole expert SwiGLU in the padded layout
               (`_blocked_routed`, one custom VJP): forward, one gather of the tokens straight
               into the experts' padded slots (slot p holds token order_m[src_p] // K, zero in
               padding), gate|up [blocks, b, D] x [blocks, D, 2F], silu * up, down [blocks, b, F]
               x [blocks, F, D], one gather of the slots straight into the (token, k) rows of the
               float32 weighted sum (rows of other shards' experts read zero), and the two
               per-block weight gathers. It keeps only its inputs and gate|up for the backward
               (no [slots, D] or [T, K, D] activation): the output's cotangent gathered into the
               slots (unweighted), u = W_down g per slot, the mixing weights' gradient <u, h>
               (= <g, y>), the weight gradients as each block's x_b^T g_b in float32 summed over
               its expert's blocks by a one-hot [E, blocks] matmul, the tokens gathered again for
               W_in's, and each token's K slots' input gradients summed in float32. Autodiff of
               the gathers would scatter-add instead, into [T, D], [E, D, 2F] and [E, F, D]
               (atomics on the GPU). As a plain grouped matmul (`expert_swiglu`, the ragged_dot
               contract) it gathers the sorted rows into the blocks and back around the batched
               matmul, with the same kind of backward
    'tokamax'  tokamax.ragged_dot(implementation='mosaic'): Mosaic GPU kernels for the forward and
               both gradients (the weight gradient by its ragged-contraction kernel); NVIDIA GPU
               only; bf16 or f16 operands (its backward does not take float32); D and F multiples
               of 64 (the kernels' 128-byte contraction tile). On an H200 (tokamax 0.0.17) its
               forward and input gradient are as close to float64 as lax.ragged_dot's, but its
               weight gradients are several times further off than the bf16 rounding that 'xla'
               and 'xla_blocked' show (experiments/tools/moe_accuracy.py; figures in
               experiments/results/moe.md), so no config selects it.
    'pallas'   the padded layout of 'xla_blocked' with blocks of settings.block_m rows (128 by
               default: the kernels' row tile) and Pallas (Triton) kernels between the same XLA
               gathers (kernels_pallas/moe/; interpreted off an NVIDIA GPU): the tile matmul reads
               each tile's expert matrix in place (no per-block weight copy), gate|up runs with
               the SwiGLU epilogue in float32 (h written once, gate|up kept for the backward),
               the weight gradients by one kernel that walks each expert's tiles. The same
               maths and residuals as `_padded_swiglu`; its backward shares its SwiGLU part
               (`_swiglu_backward`). D and F multiples of 16; settings: a MoeSettings
               (model.kernels.moe). Slower than 'xla_blocked' on an H100 (experiments/results/
               moe.md): no config selects it.
    'mosaic'   'pallas' with Mosaic GPU kernels (kernels_pallas/moe/grouped_mosaic.py: TMA, wgmma,
               pipelined contraction) in place of the Triton ones, the same functions over the same
               layout and the same custom VJPs; `tile_kernels` picks the module by the settings'
               type, a MosaicMoeSettings. bf16 or f16; D and F multiples of 64; Mosaic GPU's
               interpret mode off an NVIDIA GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels_pallas.settings import Settings

RENORM_EPS = 1e-20  # added to the chosen scores' sum before dividing (as released)
SCORE_FUNCS = ('sigmoid', 'softmax')
EXPERT_AXIS = 'expert'  # the mesh axis the experts are split over


def _fmt(shape) -> str:
  return '[' + ', '.join(str(int(d)) for d in shape) + ']'


# ----------------------------------------------------------------------------- routing


def check_routing(
  *, num_experts: int, top_k: int, n_group: int = 1, topk_group: int = 1, score_func: str = 'sigmoid', prefix: str = ''
) -> None:
  """Raises a ValueError naming the keys (with `prefix`, e.g. 'model.moe.') of an impossible
  routing: top_k > num_experts, groups that do not divide the experts, topk_group > n_group,
  groups of one expert (a group's score needs two), fewer eligible experts than top_k."""
  k = lambda name, value: f'{prefix}{name}={value!r}'
  if score_func not in SCORE_FUNCS:
    raise ValueError(f'{k("score_func", score_func)} is unknown; allowed: {SCORE_FUNCS}')
  if num_experts < 1 or top_k < 1:
    raise ValueError(f'{k("num_experts", num_experts)} and {k("top_k", top_k)} must be >= 1')
  if top_k > num_experts:
    raise ValueError(f'{k("top_k", top_k)} exceeds {k("num_experts", num_experts)}')
  if n_group < 1 or num_experts % n_group:
    raise ValueError(f'{k("n_group", n_group)} must be >= 1 and divide {k("num_experts", num_experts)}')
  if not 1 <= topk_group <= n_group:
    raise ValueError(f'{k("topk_group", topk_group)} must be in [1, {k("n_group", n_group)}]')
  size = num_experts // n_group
  if n_group > 1 and size < 2:
    raise ValueError(
      f'{k("n_group", n_group)} leaves {size} expert per group of '
      f'{k("num_experts", num_experts)}; a group is scored by its two best experts'
    )
  if top_k > topk_group * size:
    raise ValueError(
      f'{k("top_k", top_k)} exceeds the {topk_group * size} experts eligible with '
      f'{k("topk_group", topk_group)} of {k("n_group", n_group)} groups of {size}'
    )


# float32 products to float32 accuracy on tensor cores: each operand split into three bf16 terms and
# the six largest of their products accumulated in float32 (a backend without it, such as XLA:CPU,
# multiplies in float32). Precision.HIGHEST instead takes the GPU's CUDA-core float32 path, several
# times slower (experiments/bench/bench_dot_f32.py).
F32_ALGORITHM = jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6


def _dot_f32(a, b):
  """a @ b in float32 by F32_ALGORITHM; its gradients use the same algorithm."""
  return jnp.matmul(
    a.astype(jnp.float32), b.astype(jnp.float32), precision=F32_ALGORITHM, preferred_element_type=jnp.float32
  )


def router_logits(x_td, router_de):
  """The router logits u = x W_r [T, E] in float32 (to float32 accuracy, forward and backward). A
  bf16 x (the compute dtype) goes to the tensor cores as it is (_router_logits_bf16); any other x
  is cast to float32 for F32_ALGORITHM."""
  if x_td.dtype == jnp.bfloat16:
    return _router_logits_bf16(x_td, router_de.astype(jnp.float32))
  return _dot_f32(x_td, router_de)


def _bf16_terms(a):
  """a float32 as three bf16 terms, a = hi + mid + lo to about float32's 24 bits (F32_ALGORITHM's
  split), stacked on a new last axis."""
  hi = a.astype(jnp.bfloat16)
  rest = a - hi.astype(jnp.float32)
  mid = rest.astype(jnp.bfloat16)
  return jnp.stack([hi, mid, (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)], axis=-1)


def _sum_terms_dot(a, b_k3n):
  """sum_j a @ b_k3n[:, j] for bf16 a [M, K] and three bf16 terms b [K, 3, N]: one GEMM of a against
  the terms side by side, accumulated in float32, then the three columns' sums (float32 [M, N])."""
  k, _, n = b_k3n.shape
  return jnp.sum(jnp.matmul(a, b_k3n.reshape(k, 3 * n), preferred_element_type=jnp.float32).reshape(-1, 3, n), axis=1)


@jax.custom_vjp
def _router_logits_bf16(x_td, router_de):
  """x W_r for a bf16 x and a float32 W_r: the products F32_ALGORITHM computes, without its split
  of x (a bf16 x is its own first term, its others are zero), so x is never copied or cast: x
  against W_r's three bf16 terms in one GEMM. Its gradient in W_r likewise (x^T against the three
  terms of the cotangent); in x by F32_ALGORITHM on the small operands, rounded to bf16."""
  return _sum_terms_dot(x_td, _bf16_terms(router_de).transpose(0, 2, 1))


def _router_logits_bf16_fwd(x_td, router_de):
  return _router_logits_bf16(x_td, router_de), (x_td, router_de)


def _router_logits_bf16_bwd(res, du_te):
  x_td, router_de = res
  dx_td = _dot_f32(du_te, router_de.T).astype(x_td.dtype)
  dw_de = _sum_terms_dot(x_td.T, _bf16_terms(du_te).transpose(0, 2, 1))
  return dx_td, dw_de


_router_logits_bf16.defvjp(_router_logits_bf16_fwd, _router_logits_bf16_bwd)


class Routing(NamedTuple):
  """weights_tk float32 (the mixing weights w), experts_tk int32 (the chosen experts K_t, best
  first by biased score), scores_te float32 (s, unbiased)."""

  weights_tk: jax.Array
  experts_tk: jax.Array
  scores_te: jax.Array


def route(
  logits_te,
  bias_e=None,
  *,
  top_k: int,
  score_func: str = 'sigmoid',
  n_group: int = 1,
  topk_group: int = 1,
  renormalize: bool = True,
  scaling_factor: float = 1.0,
) -> Routing:
  """The released routing (module docstring) of router logits [T, E] (cast to float32) with the
  per-expert bias [E] (float32; None: zeros). Differentiable in the logits through the weights; the
  choice carries no gradient and the bias none at all. Ties go to the lower expert index. Experts
  outside the best groups are excluded (-inf), as DeepSeek-V3's inference code does; transformers'
  masked_fill(0.0) chooses the same experts whenever the eligible biased scores are positive."""
  if logits_te.ndim != 2:
    raise ValueError(f'route: logits must be [T, E], got {_fmt(logits_te.shape)}')
  t, e = logits_te.shape
  check_routing(num_experts=e, top_k=top_k, n_group=n_group, topk_group=topk_group, score_func=score_func)
  if bias_e is not None and bias_e.shape != (e,):
    raise ValueError(f'route: bias must be [E] = [{e}] for logits {_fmt(logits_te.shape)}, got {_fmt(bias_e.shape)}')
  logits_te = logits_te.astype(jnp.float32)
  scores_te = jax.nn.sigmoid(logits_te) if score_func == 'sigmoid' else jax.nn.softmax(logits_te, axis=-1)
  choice_te = jax.lax.stop_gradient(scores_te)
  if bias_e is not None:
    choice_te = choice_te + jax.lax.stop_gradient(bias_e.astype(jnp.float32))
  if n_group > 1:
    choice_tgs = choice_te.reshape(t, n_group, e // n_group)
    group_tg = jnp.sum(jax.lax.top_k(choice_tgs, 2)[0], axis=-1)
    _, best_tg = jax.lax.top_k(group_tg, topk_group)
    eligible_tg = jnp.any(best_tg[:, :, None] == jnp.arange(n_group), axis=1)
    choice_te = jnp.where(eligible_tg[:, :, None], choice_tgs, -jnp.inf).reshape(t, e)
  _, experts_tk = jax.lax.top_k(choice_te, top_k)
  # The chosen scores as a select and a sum over E (exact: one term is nonzero), whose transpose is
  # a broadcast, where take_along_axis's would scatter-add into [T, E].
  chosen_tke = experts_tk[:, :, None] == jnp.arange(e, dtype=experts_tk.dtype)
  weights_tk = jnp.sum(jnp.where(chosen_tke, scores_te[:, None, :], 0.0), axis=-1)
  if renormalize:
    weights_tk = weights_tk / (jnp.sum(weights_tk, axis=-1, keepdims=True) + RENORM_EPS)
  return Routing(weights_tk * scaling_factor, experts_tk.astype(jnp.int32), scores_te)


# ----------------------------------------------------------------------------- dispatch


class Dispatch(NamedTuple):
  """The (token, k) rows sorted by expert. order_m [M = T*K] int32: sorted row r is flattened row
  order_m[r] (= token * K + k); inverse_m [M]: the sorted position of each flattened row;
  group_sizes_e [E_local] int32: rows per (local) expert, in order; their sum <= M, and the sorted
  rows past it go to experts on other shards (expert parallelism)."""

  order_m: jax.Array
  inverse_m: jax.Array
  group_sizes_e: jax.Array


def sort_by_expert(experts_tk, num_experts: int, *, first_expert=0) -> Dispatch:
  """Sorts the rows of experts_tk [T, K] by expert, for the experts first_expert ..
  first_expert + num_experts - 1 (first_expert may be traced); rows of other experts go last.
  Stable: within an expert rows keep token order."""
  local_m = experts_tk.reshape(-1).astype(jnp.int32) - first_expert
  key_m = jnp.where((local_m >= 0) & (local_m < num_experts), local_m, num_experts)
  order_m = jnp.argsort(key_m.astype(_sort_key_dtype(num_experts)), stable=True).astype(jnp.int32)
  m = key_m.shape[0]
  inverse_m = jnp.zeros((m,), jnp.int32).at[order_m].set(jnp.arange(m, dtype=jnp.int32), unique_indices=True)
  group_sizes_e = _counts(key_m, num_experts)
  return Dispatch(order_m, inverse_m, group_sizes_e)


def _sort_key_dtype(num_experts: int):
  """The narrowest unsigned integer holding the sort keys 0 .. num_experts: a GPU radix sort makes one
  pass per 8 bits of key, so uint8 keys (up to 255 experts) take one pass where int32 take four."""
  for dtype in (jnp.uint8, jnp.uint16):
    if num_experts <= jnp.iinfo(dtype).max:
      return dtype
  return jnp.int32


def _counts(ids, n: int):
  """int32 [..., n]: how many of the ids on the last axis of `ids` equal each of 0 .. n - 1, as a
  compare-and-sum reduction (XLA fuses it: no [..., n, M] array), where a bincount would
  scatter-add one per id into n counters (contended atomics on the GPU)."""
  ids = ids.astype(jnp.int32)
  return jnp.sum(ids[..., None, :] == jnp.arange(n, dtype=jnp.int32)[:, None], axis=-1, dtype=jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_rows(x_td, order_m, inverse_m, top_k):
  return x_td[order_m // top_k]


def _gather_rows_fwd(x_td, order_m, inverse_m, top_k):
  return x_td[order_m // top_k], (order_m, inverse_m, x_td.shape[0])


def _gather_rows_bwd(top_k, res, g_md):
  # The transpose is a gather too (no scatter-add), and the sum over a token's k rows is float32.
  order_m, inverse_m, t = res
  g_tkd = g_md[inverse_m].reshape(t, top_k, -1)
  return jnp.sum(g_tkd, axis=1, dtype=jnp.float32).astype(g_md.dtype), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


@jax.custom_vjp
def _ungather_rows(y_md, order_m, inverse_m):
  return y_md[inverse_m]


def _ungather_rows_fwd(y_md, order_m, inverse_m):
  return y_md[inverse_m], order_m


def _ungather_rows_bwd(order_m, g_md):
  return g_md[order_m], None, None


_ungather_rows.defvjp(_ungather_rows_fwd, _ungather_rows_bwd)


def _local_rows(dispatch: Dispatch):
  """[M] bool: sorted row r goes to a local expert (r < the local experts' total)."""
  return jnp.arange(dispatch.order_m.shape[0]) < jnp.sum(dispatch.group_sizes_e)


def permute(x_td, dispatch: Dispatch, top_k: int, *, all_local: bool = True):
  """The sorted rows' inputs [M, D] = x_td[order_m // K], in x's dtype. Rows for other shards'
  experts are zero unless all_local (so that a kernel never reads or returns garbage for them)."""
  x_md = _gather_rows(x_td, dispatch.order_m, dispatch.inverse_m, top_k)
  return x_md if all_local else jnp.where(_local_rows(dispatch)[:, None], x_md, 0)


def combine(y_md, dispatch: Dispatch, weights_tk, *, all_local: bool = True):
  """y_td [T, D] float32 = sum_k weights_tk[t, k] * y of row (t, k): the inverse permutation of
  the sorted rows y_md [M, D] and the weighted sum, in float32. Rows for other shards' experts
  count zero unless all_local."""
  t, k = weights_tk.shape
  if not all_local:
    y_md = jnp.where(_local_rows(dispatch)[:, None], y_md, 0)
  y_tkd = _ungather_rows(y_md, dispatch.order_m, dispatch.inverse_m).reshape(t, k, -1)
  return _weighted_sum(weights_tk, y_tkd)


def _weighted_sum(weights_tk, y_tkd):
  """[T, D] float32 = sum_k weights_tk[t, k] y_tkd[t, k]: a product and a sum over k (one fused
  reduction), not a dot, which would run as T tiny [1, K] x [K, D] matrix multiplications."""
  return jnp.sum(weights_tk.astype(jnp.float32)[:, :, None] * y_tkd.astype(jnp.float32), axis=1)


# ----------------------------------------------------------------------------- the grouped matmul


def swiglu(gate, up):
  """An expert's activation h = silu(gate) * up, elementwise (the padded layouts run it in float32;
  so do the kernels of kernels_pallas/moe/, in their epilogues)."""
  return jax.nn.silu(gate) * up


def swiglu_backward(gate, up, dh):
  """SwiGLU's backward, elementwise: (d gate, d up, h) for h = silu(gate) * up and its cotangent
  dh (float32 in the padded layouts and in the Mosaic GPU kernel that fuses it)."""
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  return dh * up * sig * (1 + gate * (1 - sig)), dh * silu, silu * up


def _xla_ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, settings=None):
  del settings  # no kernels
  return jax.lax.ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, preferred_element_type=lhs_mk.dtype)


def _tokamax_ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, settings=None):
  del settings  # tokamax's own kernels, not configured here
  import tokamax  # lazily: only the GPU path needs it

  return tokamax.ragged_dot(
    lhs_mk, rhs_gkn, group_sizes_g, preferred_element_type=lhs_mk.dtype, implementation='mosaic'
  )


@dataclasses.dataclass(frozen=True)
class BlockedSettings(Settings):
  """'xla_blocked''s layout: b, the rows per block, is the power of two nearest M / (blocks_per_group
  G) for M rows in G groups, at least 8. More blocks per group pad less (each group's last block
  is partly empty, and the layout holds G trailing blocks for the worst case) but gather one
  weight matrix per block and multiply smaller blocks: on an H200 the default 4 is the fastest of
  4, 8 and 16 (experiments/results/moe.md). The config takes it as model.kernels.moe
  ('blocks_per_group=8') with model.moe.impl='xla_blocked'."""

  FAMILY = 'moe xla_blocked'

  blocks_per_group: int = 4


def _block_rows(m: int, g: int, settings: BlockedSettings | None) -> int:
  """xla_blocked's block size for m rows in g groups (static): the power of two nearest m /
  (blocks_per_group g), at least 8; settings None: the defaults."""
  if settings is None:
    settings = BlockedSettings()
  if not isinstance(settings, BlockedSettings):
    raise TypeError(f"moe impl='xla_blocked': settings must be a BlockedSettings or None, got {type(settings)}")
  return max(8, 1 << max(round(math.log2(max(m / (settings.blocks_per_group * g), 1))), 0))


class _Blocks(NamedTuple):
  """xla_blocked's layout of M rows in G groups: slots of `blocks` blocks of b rows, each group's
  rows first in its own whole blocks (groups in order), then the trailing blocks past the last
  group. src_p [blocks * b] int32: the row in slot p, M for a padding slot; dest_r [M] int32: the
  slot of row r, blocks * b for rows past the groups' total; group_b [blocks] int32: the group of
  block i, G for the trailing blocks. src_p and dest_r are inverse maps on the groups' rows."""

  src_p: jax.Array
  dest_r: jax.Array
  group_b: jax.Array

  @property
  def blocks(self) -> int:
    return self.group_b.shape[0]

  @property
  def b(self) -> int:
    return self.src_p.shape[0] // self.group_b.shape[0]


def _blocked_layout(m: int, group_sizes_g, b: int) -> _Blocks:
  """The padded layout of m rows in the groups of group_sizes_g [G], blocks of b rows."""
  g = group_sizes_g.shape[0]
  blocks = -(-m // b) + g  # enough for every group padded up to whole blocks
  sizes = group_sizes_g.astype(jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  padded = -(-sizes // b) * b
  padded_ends = jnp.cumsum(padded)
  padded_starts = padded_ends - padded
  slot = jnp.arange(blocks * b, dtype=jnp.int32)
  # method='compare_all': each slot against the G ends in one fused reduction, where the default
  # binary search runs as a loop of log2(G) dependent steps
  group_p = jnp.searchsorted(padded_ends, slot, side='right', method='compare_all').astype(jnp.int32)  # G past the end
  clamped_p = jnp.minimum(group_p, g - 1)
  offset_p = slot - padded_starts[clamped_p]  # >= the group's size in padding and trailing slots
  src_p = jnp.where(offset_p < sizes[clamped_p], starts[clamped_p] + offset_p, m)
  row = jnp.arange(m, dtype=jnp.int32)
  group_r = jnp.minimum(jnp.searchsorted(ends, row, side='right', method='compare_all'), g - 1).astype(jnp.int32)
  dest_r = jnp.where(row < ends[-1], padded_starts[group_r] + row - starts[group_r], blocks * b)
  return _Blocks(src_p, dest_r, group_p[::b])


def _rows(a, index):
  """a[index] along the first axis, zero where index is out of range (a gather)."""
  return a.at[index].get(mode='fill', fill_value=0)


@jax.custom_vjp
def _take_rows(a, index_n, inverse_ak):
  """a[index_n] along the first axis, zero where index_n is out of range; differentiable in `a`
  with a gather for a transpose: inverse_ak [A, K] lists, for each row of a, the K positions that
  read it (out of range: none), and index_n[inverse_ak[i, j]] = i wherever inverse_ak[i, j] is in
  range. The cotangent of row i is the sum of those K positions' cotangents, in float32."""
  return _rows(a, index_n)


def _take_rows_fwd(a, index_n, inverse_ak):
  return _rows(a, index_n), (index_n, inverse_ak)


def _take_rows_bwd(res, g_n):
  index_n, inverse_ak = res
  g_ak = _rows(g_n, inverse_ak)  # [A, K, ...]
  g_a = g_ak[:, 0] if inverse_ak.shape[1] == 1 else jnp.sum(g_ak, axis=1, dtype=jnp.float32).astype(g_n.dtype)
  return g_a, None, None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _block_matrices(w_gkn, group_i, dtype):
  return w_gkn.astype(dtype)[jnp.minimum(group_i, w_gkn.shape[0] - 1)]


def _block_products(x_ibk, w_gkn, group_i, out_dtype=None):
  """[blocks, b, K] x their group's matrix [K, N] -> [blocks, b, N] (in x's dtype by default): one
  batched matmul against the matrices gathered per block (group_i [blocks]: G or more for blocks
  of no group, which take the last group's matrix and must hold zero rows)."""
  w_ikn = _block_matrices(w_gkn, group_i, x_ibk.dtype)
  return jnp.einsum('ibk,ikn->ibn', x_ibk, w_ikn, preferred_element_type=out_dtype or x_ibk.dtype)


def _block_products_t(g_ibn, w_gkn, group_i, out_dtype=None):
  """[blocks, b, N] x their group's matrix transposed [N, K] -> [blocks, b, K]: the input gradient
  of _block_products."""
  w_ikn = _block_matrices(w_gkn, group_i, g_ibn.dtype)
  return jnp.einsum('ibn,ikn->ibk', g_ibn, w_ikn, preferred_element_type=out_dtype or g_ibn.dtype)


def _block_weight_grad(x_ibk, g_ibn, group_i, w_gkn):
  """The weights' gradient of _block_products, [G, K, N] in w's dtype: each block's x_b^T g_b in
  float32, summed over its group's blocks by a one-hot [G, blocks] matmul (autodiff of the
  per-block gather would scatter-add into [G, K, N])."""
  g, k, n = w_gkn.shape
  dw_ikn = jnp.einsum('ibk,ibn->ikn', x_ibk, g_ibn, preferred_element_type=jnp.float32)
  one_hot_gi = (group_i[None, :] == jnp.arange(g, dtype=jnp.int32)[:, None]).astype(jnp.float32)
  dw = _dot_f32(one_hot_gi, dw_ikn.reshape(-1, k * n))  # the sum in float32, on tensor cores
  return dw.reshape(g, k, n).astype(w_gkn.dtype)


@jax.custom_vjp
def _blocked_matmul(x_ibk, w_gkn, group_i):
  """_block_products, differentiable in x and w with matmuls only (no scatter-add)."""
  return _block_products(x_ibk, w_gkn, group_i)


def _blocked_matmul_fwd(x_ibk, w_gkn, group_i):
  return _block_products(x_ibk, w_gkn, group_i), (x_ibk, w_gkn, group_i)


def _blocked_matmul_bwd(res, g_ibn):
  x_ibk, w_gkn, group_i = res
  g_ibn = g_ibn.astype(x_ibk.dtype)
  return _block_products_t(g_ibn, w_gkn, group_i), _block_weight_grad(x_ibk, g_ibn, group_i, w_gkn), None


_blocked_matmul.defvjp(_blocked_matmul_fwd, _blocked_matmul_bwd)


def _padded_ragged_dot(lhs_mk, rhs_gkn, layout: _Blocks, slot_matmul):
  """A grouped matmul through the padded layout: the rows gathered into the slots, slot_matmul(x
  [slots, K], rhs, group_b) -> [slots, N] (differentiable in x and rhs), a gather back. Rows past
  the groups' total come out zero and their cotangent reaches nothing."""
  x_pk = _take_rows(lhs_mk, layout.src_p, layout.dest_r[:, None])
  y_pn = slot_matmul(x_pk, rhs_gkn, layout.group_b)
  return _take_rows(y_pn, layout.dest_r, layout.src_p[:, None])


def _blocked_ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, settings=None):
  """'xla_blocked' as a grouped matmul (module docstring): the rows gathered into whole blocks,
  one batched matmul, a gather back; the backward gathers and multiplies, with no scatter-add.
  Rows past the groups' total come out zero and their cotangent reaches nothing. settings: a
  BlockedSettings or None (the defaults)."""
  m, k = lhs_mk.shape
  layout = _blocked_layout(m, group_sizes_g, _block_rows(m, group_sizes_g.shape[0], settings))

  def slot_matmul(x_pk, w_gkn, group_b):
    return _blocked_matmul(x_pk.reshape(layout.blocks, layout.b, k), w_gkn, group_b).reshape(x_pk.shape[0], -1)

  return _padded_ragged_dot(lhs_mk, rhs_gkn, layout, slot_matmul)


def _slot_maps(layout: _Blocks, dispatch: Dispatch, t: int, k: int):
  """(row_p [slots]: the (token, k) row in slot p, t * k in padding slots; slot_tk [T, K]: the slot
  of row (t, k), blocks * b (none) for rows of other shards' experts)."""
  row_p = dispatch.order_m.at[layout.src_p].get(mode='fill', fill_value=t * k)
  return row_p, layout.dest_r[dispatch.inverse_m].reshape(t, k)


def _blocked_routed(x_td, weights_tk, dispatch: Dispatch, w_gate_edf, w_up_edf, w_down_efd, settings=None):
  """'xla_blocked''s routed experts in the padded layout (module docstring). Rows of other shards'
  experts have no slot and count zero. settings: a BlockedSettings or None (the defaults)."""
  t, k = weights_tk.shape
  layout = _blocked_layout(t * k, dispatch.group_sizes_e, _block_rows(t * k, dispatch.group_sizes_e.shape[0], settings))
  row_p, slot_tk = _slot_maps(layout, dispatch, t, k)
  w_in_ed2f = jnp.concatenate([w_gate_edf, w_up_edf], axis=-1)
  return _padded_swiglu(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, layout.group_b)


@jax.custom_vjp
def _padded_swiglu(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b):
  """sum_k weights_tk[t, k] W_down_e^T (silu(gate) * up), [gate | up] = W_in_e^T x_t for the expert
  e of row (t, k), float32 [T, D], in the padded layout: row_p [slots] the (token, k) row of each
  slot (T * K in padding), slot_tk [T, K] the slot of each row (out of range: none), group_b
  [blocks] the expert of each block of slots / blocks rows."""
  return _padded_swiglu_fwd(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b)[0]


def _slots(a_td, row_p, top_k, blocks):
  """The tokens' rows a_td [T, D] in the slots, [blocks, b, D], zero in padding slots."""
  return _rows(a_td, row_p // top_k).reshape(blocks, -1, a_td.shape[-1])


def _padded_swiglu_fwd(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b):
  t, k = weights_tk.shape
  x_ibd = _slots(x_td, row_p, k, group_b.shape[0])
  gate_up_ib2f = _block_products(x_ibd, w_in_ed2f, group_b)
  f = gate_up_ib2f.shape[-1] // 2
  gate, up = gate_up_ib2f[..., :f].astype(jnp.float32), gate_up_ib2f[..., f:].astype(jnp.float32)
  h_ibf = swiglu(gate, up).astype(x_td.dtype)  # zero in padding slots
  y_pd = _block_products(h_ibf, w_down_efd, group_b).reshape(-1, x_td.shape[-1])
  y_td = _weighted_sum(weights_tk, _rows(y_pd, slot_tk))
  return y_td, (x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, gate_up_ib2f)


def _padded_swiglu_bwd(res, g_td):
  """Saved: the inputs and gate|up only (no [slots, D] or [T, K, D] array). With u = W_down_e g_t
  for the row's expert and h = silu(gate) * up: d weights_tk = <u, h> (= <g_t, y_tk>), dh =
  weights_tk u, d W_down_e = sum of (weights_tk h)^T g_t over its rows, then SwiGLU's and gate|up's
  gradients; the tokens re-gathered into the slots for d W_in, each token's K slots summed in
  float32 for dx."""
  x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, gate_up_ib2f = res
  t, k = weights_tk.shape
  blocks, dtype = group_b.shape[0], x_td.dtype
  g_ibd = _slots(g_td.astype(dtype), row_p, k, blocks)
  w_ib1 = _rows(weights_tk.reshape(-1), row_p).reshape(blocks, -1, 1)  # zero in padding slots
  u_ibf = _block_products_t(g_ibd, w_down_efd, group_b, out_dtype=jnp.float32)
  d_weights_tk, wh_ibf, d_gate_up_ib2f = _swiglu_backward(gate_up_ib2f, u_ibf, w_ib1, slot_tk, dtype)
  d_w_down = _block_weight_grad(wh_ibf, g_ibd, group_b, w_down_efd)
  d_w_in = _block_weight_grad(_slots(x_td, row_p, k, blocks), d_gate_up_ib2f, group_b, w_in_ed2f)
  dx_pd = _block_products_t(d_gate_up_ib2f, w_in_ed2f, group_b).reshape(-1, x_td.shape[-1])
  dx_td = jnp.sum(_rows(dx_pd, slot_tk), axis=1, dtype=jnp.float32).astype(dtype)
  return dx_td, d_weights_tk.astype(weights_tk.dtype), d_w_in, d_w_down, None, None, None


_padded_swiglu.defvjp(_padded_swiglu_fwd, _padded_swiglu_bwd)


def _swiglu_backward(gate_up_x2f, u_xf, w_x1, slot_tk, dtype):
  """The padded layout's SwiGLU backward in float32, for slots of any leading shape x: gate|up
  [x, 2F] (saved, the compute dtype), u = W_down_e g [x, F] float32 and each slot's mixing weight
  w [x, 1] (zero in padding slots) -> (d weights_tk [T, K] float32 = <u, h> of each row's slot;
  w h [x, F] and d gate|up [x, 2F] in dtype), h = silu(gate) * up, dh = w u."""
  f = gate_up_x2f.shape[-1] // 2
  gate, up = gate_up_x2f[..., :f].astype(jnp.float32), gate_up_x2f[..., f:].astype(jnp.float32)
  d_gate, d_up, h_xf = swiglu_backward(gate, up, w_x1 * u_xf)
  d_weights_tk = _rows(jnp.sum(u_xf * h_xf, axis=-1).reshape(-1), slot_tk)
  return d_weights_tk, (w_x1 * h_xf).astype(dtype), jnp.concatenate([d_gate, d_up], axis=-1).astype(dtype)


# ----------------------------------------------------------------------------- 'pallas': the padded layout's kernels


def _pallas_settings(text: str):
  from kernels_pallas.moe.settings import MoeSettings

  return MoeSettings.from_string(text)


def _mosaic_settings(text: str):
  from kernels_pallas.moe.settings import MosaicMoeSettings

  return MosaicMoeSettings.from_string(text)


def tile_kernels(settings):
  """run(name, *args, **kw): the kernel `name` of the module these settings belong to,
  kernels_pallas.moe.grouped (Triton) for a MoeSettings, .grouped_mosaic (Mosaic GPU) for a
  MosaicMoeSettings, with these settings, interpreted off the GPU."""
  import importlib

  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.moe.settings import MoeSettings, MosaicMoeSettings

  modules = {MoeSettings: 'grouped', MosaicMoeSettings: 'grouped_mosaic'}
  if type(settings) not in modules:
    raise TypeError(f'moe tile kernels: settings must be a MoeSettings or a MosaicMoeSettings, got {type(settings)}')
  kernels = importlib.import_module(f'kernels_pallas.moe.{modules[type(settings)]}')
  interpret = kernels_interpreted()

  def run(name, *args, **kw):
    return getattr(kernels, name)(*args, settings=settings, interpret=interpret, **kw)

  return run


def _tile_impl(impl: str, parse: Callable[[str], object]):
  """{ragged_dot, routed} of the tile kernels for `impl`, an Implementation's two fields: settings
  None -> parse('') (the defaults); settings of another type -> a TypeError naming the impl."""

  def resolve(settings):
    default = parse('')
    if settings is not None and type(settings) is not type(default):
      raise TypeError(f'moe impl={impl!r}: settings must be a {type(default).__name__} or None, got {type(settings)}')
    return default if settings is None else settings

  ragged_dot = lambda lhs, rhs, sizes, settings=None: _pallas_ragged_dot(lhs, rhs, sizes, resolve(settings))
  routed = lambda x, w, dispatch, wg, wu, wd, settings=None: _pallas_routed(
    x, w, dispatch, wg, wu, wd, resolve(settings)
  )
  return {'ragged_dot': ragged_dot, 'routed': routed}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tile_matmul(x_pk, w_gkn, group_b, settings):
  """The tile matmul kernel (each tile of block_m slots times its group's matrix, [slots, N] in x's
  dtype), differentiable in x and w by the same kernel transposed and the expert weight gradient
  kernel."""
  run = tile_kernels(settings)
  return run('tile_matmul', x_pk, w_gkn.astype(x_pk.dtype), group_b)


def _tile_matmul_fwd(x_pk, w_gkn, group_b, settings):
  return _tile_matmul(x_pk, w_gkn, group_b, settings), (x_pk, w_gkn, group_b)


def _tile_matmul_bwd(settings, res, g_pn):
  x_pk, w_gkn, group_b = res
  run = tile_kernels(settings)
  g_pn = g_pn.astype(x_pk.dtype)
  dx_pk = run('tile_matmul', g_pn, w_gkn.astype(x_pk.dtype), group_b, transpose=True)
  dw = run('expert_weight_grad', x_pk, g_pn, group_b, num_experts=w_gkn.shape[0])
  return dx_pk, dw.astype(w_gkn.dtype), None


_tile_matmul.defvjp(_tile_matmul_fwd, _tile_matmul_bwd)


def _pallas_ragged_dot(lhs_mk, rhs_gkn, group_sizes_g, settings):
  """'pallas' and 'mosaic' as a grouped matmul: the rows gathered into the padded layout's slots
  (blocks of block_m rows), the tile matmul kernel, a gather back; its backward the same kernel on
  the transposed weights and the expert weight gradient kernel (no scatter-add). settings: a
  MoeSettings (Triton) or MosaicMoeSettings (Mosaic GPU)."""
  layout = _blocked_layout(lhs_mk.shape[0], group_sizes_g, settings.block_m)
  slot_matmul = lambda x_pk, w_gkn, group_b: _tile_matmul(x_pk, w_gkn, group_b, settings)
  return _padded_ragged_dot(lhs_mk, rhs_gkn, layout, slot_matmul)


def _pallas_routed(x_td, weights_tk, dispatch: Dispatch, w_gate_edf, w_up_edf, w_down_efd, settings):
  """'pallas''s and 'mosaic''s routed experts (module docstring): the padded layout with blocks of
  block_m rows, the kernels of kernels_pallas/moe (those of the settings' type) between XLA's
  gathers, the maths and residuals of _padded_swiglu. Rows of other shards' experts have no slot
  and count zero."""
  t, k = weights_tk.shape
  layout = _blocked_layout(t * k, dispatch.group_sizes_e, settings.block_m)
  row_p, slot_tk = _slot_maps(layout, dispatch, t, k)
  w_in_ed2f = jnp.concatenate([w_gate_edf, w_up_edf], axis=-1)
  return _tiled_swiglu(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, layout.group_b, settings)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _tiled_swiglu(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, settings):
  """_padded_swiglu's output with the kernels: group_b [tiles] the expert of each tile of
  settings.block_m slots."""
  return _tiled_swiglu_fwd(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, settings)[0]


def _tiled_swiglu_fwd(x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, settings):
  run = tile_kernels(settings)
  k = weights_tk.shape[1]
  dtype = x_td.dtype
  x_pd = _rows(x_td, row_p // k)
  gate_up_p2f, h_pf = run('gate_up_swiglu', x_pd, w_in_ed2f.astype(dtype), group_b)
  y_pd = run('tile_matmul', h_pf, w_down_efd.astype(dtype), group_b)
  y_td = _weighted_sum(weights_tk, _rows(y_pd, slot_tk))
  return y_td, (x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, gate_up_p2f)


def _tiled_swiglu_bwd(settings, res, g_td):
  """_padded_swiglu_bwd's formulas: u by the tile matmul on W_down transposed (float32) and SwiGLU's
  backward in XLA (_swiglu_backward), or both in one kernel (a MosaicMoeSettings with
  fused_backward=1, its default: down_swiglu_backward); the weight gradients by the expert weight
  gradient kernel, dx by the tile matmul on W_in transposed, each token's K slots summed in
  float32."""
  x_td, weights_tk, w_in_ed2f, w_down_efd, row_p, slot_tk, group_b, gate_up_p2f = res
  run = tile_kernels(settings)
  k = weights_tk.shape[1]
  e, dtype = w_in_ed2f.shape[0], x_td.dtype
  g_pd = _rows(g_td.astype(dtype), row_p // k)
  w_p1 = _rows(weights_tk.reshape(-1), row_p)[:, None]  # zero in padding slots
  from kernels_pallas.moe.settings import MosaicMoeSettings

  if isinstance(settings, MosaicMoeSettings) and settings.fused_backward:  # u stays in the kernel
    d_gate_up_p2f, wh_pf, uh_p = run(
      'down_swiglu_backward', g_pd, w_down_efd.astype(dtype), gate_up_p2f, w_p1[:, 0], group_b
    )
    d_weights_tk = _rows(uh_p, slot_tk)
  else:
    u_pf = run('tile_matmul', g_pd, w_down_efd.astype(dtype), group_b, transpose=True, out_dtype=jnp.float32)
    d_weights_tk, wh_pf, d_gate_up_p2f = _swiglu_backward(gate_up_p2f, u_pf, w_p1, slot_tk, dtype)
  d_w_down = run('expert_weight_grad', wh_pf, g_pd, group_b, num_experts=e).astype(w_down_efd.dtype)
  x_pd = _rows(x_td, row_p // k)
  d_w_in = run('expert_weight_grad', x_pd, d_gate_up_p2f, group_b, num_experts=e).astype(w_in_ed2f.dtype)
  dx_pd = run('tile_matmul', d_gate_up_p2f, w_in_ed2f.astype(dtype), group_b, transpose=True)
  dx_td = jnp.sum(_rows(dx_pd, slot_tk), axis=1, dtype=jnp.float32).astype(dtype)
  return dx_td, d_weights_tk.astype(weights_tk.dtype), d_w_in, d_w_down, None, None, None


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One grouped matmul. ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G] int32, settings=None)
  -> [M, N] in lhs's dtype: rows of group g (consecutive, in order) times rhs[g]; rows past the
  groups' total are unspecified (callers mask them, so their cotangent is zero). Differentiable in
  lhs and rhs. gpu_only: needs an NVIDIA GPU. dims_multiple: D and F must be multiples of it (1:
  any). dtypes: the operand dtypes it takes. routed: None, or the routed experts of one device in
  the implementation's own layout, (x_td, weights_tk, dispatch, w_gate, w_up, w_down, settings=None)
  -> y_td float32, run instead of permute / expert_swiglu / combine. parse_settings: 'key=int/key=int'
  -> the settings it takes (None: it takes none and ignores `settings`)."""

  ragged_dot: Callable
  gpu_only: bool
  dims_multiple: int = 1
  dtypes: tuple[str, ...] = ('bfloat16', 'float16', 'float32')
  routed: Callable | None = None
  parse_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_xla_ragged_dot, gpu_only=False),
    'xla_blocked': Implementation(
      _blocked_ragged_dot, gpu_only=False, routed=_blocked_routed, parse_settings=BlockedSettings.from_string
    ),
    'tokamax': Implementation(_tokamax_ragged_dot, gpu_only=True, dims_multiple=64, dtypes=('bfloat16', 'float16')),
    'pallas': Implementation(
      **_tile_impl('pallas', _pallas_settings),
      gpu_only=False,
      dims_multiple=16,
      parse_settings=_pallas_settings,
    ),
    'mosaic': Implementation(
      **_tile_impl('mosaic', _mosaic_settings),
      gpu_only=False,
      dims_multiple=64,
      dtypes=('bfloat16', 'float16'),
      parse_settings=_mosaic_settings,
    ),
  }
)


def unsupported(
  impl: str, dtype=jnp.bfloat16, d_model: int | None = None, hidden: int | None = None, platform: str | None = None
) -> str | None:
  """Why the grouped matmul `impl` cannot run for inputs of `dtype` with model width d_model and
  expert hidden width `hidden` on `platform` (default: JAX's default backend), or None."""
  if impl not in IMPLS:
    return f'moe impl={impl!r} is unknown; allowed: {tuple(IMPLS)}'
  spec = IMPLS[impl]
  platform = platform or jax.default_backend()
  if spec.gpu_only and platform != 'gpu':
    return (
      f"moe impl={impl!r} needs an NVIDIA GPU, but JAX runs on {platform!r} here; use impl='xla_blocked' "
      "(model.moe.impl='xla_blocked') off the GPU"
    )
  if jnp.dtype(dtype).name not in spec.dtypes:
    return f'moe impl={impl!r} needs {" or ".join(spec.dtypes)} inputs, got {jnp.dtype(dtype)}'
  for name, size in (('d_model', d_model), ('expert hidden', hidden)):
    if size is not None and size % spec.dims_multiple:
      return f'moe impl={impl!r} needs {name} ({size}) to be a multiple of {spec.dims_multiple}'
  return None


def expert_swiglu(x_md, group_sizes_e, w_gate_edf, w_up_edf, w_down_efd, *, impl: str = 'xla', settings=None):
  """The experts' SwiGLU on sorted rows: row r of expert e -> W_down_e^T (silu(W_gate_e^T x_r) *
  (W_up_e^T x_r)), [M, D] in x's dtype; gate and up as one grouped matmul of width 2F. settings:
  the kernels' settings of an implementation that has them (None: their defaults)."""
  ragged_dot = functools.partial(IMPLS[impl].ragged_dot, settings=settings)
  f = w_gate_edf.shape[-1]
  w_in_ed2f = jnp.concatenate([w_gate_edf, w_up_edf], axis=-1).astype(x_md.dtype)
  gate_up_m2f = ragged_dot(x_md, w_in_ed2f, group_sizes_e)
  h_mf = swiglu(gate_up_m2f[:, :f], gate_up_m2f[:, f:])
  return ragged_dot(h_mf, w_down_efd.astype(x_md.dtype), group_sizes_e)


def _routed_local(
  x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd, impl, settings, first_expert=0, all_local=True
):
  """Dispatch, experts and combine on one device for its experts first_expert .. + E_local - 1."""
  top_k = experts_tk.shape[1]
  dispatch = sort_by_expert(experts_tk, w_gate_edf.shape[0], first_expert=first_expert)
  if IMPLS[impl].routed is not None:
    return IMPLS[impl].routed(x_td, weights_tk, dispatch, w_gate_edf, w_up_edf, w_down_efd, settings=settings)
  x_md = permute(x_td, dispatch, top_k, all_local=all_local)
  y_md = expert_swiglu(x_md, dispatch.group_sizes_e, w_gate_edf, w_up_edf, w_down_efd, impl=impl, settings=settings)
  return combine(y_md, dispatch, weights_tk, all_local=all_local)


# ----------------------------------------------------------------------------- the op


def _check_experts(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd, impl):
  if impl not in IMPLS:
    raise ValueError(f'routed_experts impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  if (
    x_td.ndim != 2
    or weights_tk.ndim != 2
    or experts_tk.shape != weights_tk.shape
    or weights_tk.shape[0] != x_td.shape[0]
  ):
    raise ValueError(
      f'routed_experts expects x [T, D], weights and experts [T, K]; got x '
      f'{_fmt(x_td.shape)}, weights {_fmt(weights_tk.shape)}, experts {_fmt(experts_tk.shape)}'
    )
  t, d = x_td.shape
  e, _, f = w_gate_edf.shape if w_gate_edf.ndim == 3 else (0, 0, 0)
  if w_gate_edf.shape != (e, d, f) or w_up_edf.shape != (e, d, f) or w_down_efd.shape != (e, f, d):
    raise ValueError(
      f'routed_experts expects w_gate and w_up [E, D={d}, F] and w_down [E, F, D={d}] for x '
      f'{_fmt(x_td.shape)}; got w_gate {_fmt(w_gate_edf.shape)}, w_up {_fmt(w_up_edf.shape)}, '
      f'w_down {_fmt(w_down_efd.shape)}'
    )
  if weights_tk.shape[1] > e:
    raise ValueError(
      f'routed_experts: top-k {weights_tk.shape[1]} (experts [T, K] {_fmt(experts_tk.shape)}) '
      f'exceeds the {e} experts of w_gate {_fmt(w_gate_edf.shape)}'
    )
  if not jnp.issubdtype(experts_tk.dtype, jnp.integer):
    raise ValueError(f'routed_experts: experts must be integer expert ids, got dtype {experts_tk.dtype}')
  problem = unsupported(impl, x_td.dtype, d, f)
  if problem:
    raise ValueError(problem)


def _spec_entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def shard_layout(num_tokens: int, num_experts: int, token_axes=None):
  """(token_axes, expert_axis) that routed_experts uses under the current mesh: the mesh axes the
  T tokens are split over and the axis the experts are split over (None: not split). token_axes
  None: every mesh axis but 'tensor'; axes of the mesh only, trailing ones dropped until their
  product divides T (a batch too small for the mesh, e.g. decoding, is replicated instead)."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes)) if not mesh.empty else {}
  expert_axis = EXPERT_AXIS if sizes.get(EXPERT_AXIS, 1) > 1 else None
  if expert_axis and num_experts % sizes[expert_axis]:
    raise ValueError(
      f'routed_experts: the {num_experts} experts do not divide over the mesh axis '
      f'{expert_axis!r} of size {sizes[expert_axis]}'
    )
  if token_axes is None:
    token_axes = tuple(a for a in sizes if a != 'tensor')
  axes = [a for a in token_axes if sizes.get(a, 1) > 1]
  while axes and num_tokens % math.prod(sizes[a] for a in axes):
    axes.pop()
  return tuple(axes), expert_axis


def routed_experts(
  x_td,
  weights_tk,
  experts_tk,
  w_gate_edf,
  w_up_edf,
  w_down_efd,
  *,
  impl: str = 'xla',
  token_axes: tuple[str, ...] | None = None,
  settings=None,
):
  """The routed experts' output y_td [T, D] float32 (module docstring), dropless.

  Args:
    x_td: [T, D] token inputs in the compute dtype. weights_tk [T, K] float32 and experts_tk [T, K]
      int32: the routing (`route`).
    w_gate_edf, w_up_edf: [E, D, F]; w_down_efd: [E, F, D], the stacked expert weights (cast to
      x's dtype).
    impl: a key of IMPLS ('xla' | 'xla_blocked' | 'tokamax' | 'pallas' | 'mosaic'); an implementation
      with its own `routed` ('xla_blocked', 'pallas', 'mosaic': the padded layout) runs it instead of permute /
      expert_swiglu / combine.
    token_axes: under a mesh, the mesh axes the token axis of x is split over, major first (the
      layer passes those of its batch; None: see shard_layout).
    settings: the kernels' settings of an implementation that has them ('pallas': a MoeSettings,
      'mosaic': a MosaicMoeSettings, of kernels_pallas/moe/settings.py); None: their defaults.

  Under a current mesh of several devices (jax.set_mesh) the op runs per shard (shard_map): each
  device sorts its own rows and runs its grouped matmuls (a sort or a kernel split by XLA would
  gather every token). With a mesh axis 'expert' of size P > 1 the experts are split over it
  (E / P per device; other mesh axes replicate them, a sharded D or F is gathered) and, when the
  tokens are split over 'expert' too:

      all-gather x, weights and experts over 'expert' -> each device runs its E / P experts on
      the rows of the P devices' tokens that chose them, combines them with their weights into a
      float32 partial y [P * T_local, D] -> reduce-scatter (sum) over 'expert' -> y [T_local, D].

  Why all-gather / reduce-scatter rather than a (ragged) all-to-all: on one NVLink host the two
  regular collectives run at full bandwidth where ragged_all_to_all has been reported slow (~2%
  of the bandwidth on 8 GPUs; docs/moe.md); they move (P - 1) T_local D values each way
  per device, no more than an all-to-all of the T_local K rows once K >= P (top-8 over up to 8
  expert shards), because the weighted sum over k happens before the reduce-scatter; shapes stay
  static and nothing is dropped, where a dropless all-to-all needs worst-case buffers anyway; and
  the gradients are the collectives' transposes (reduce-scatter <-> all-gather), exact. The cost
  is the gathered buffer: each device sorts P T_local K rows and holds them (the worst case of a
  dropless all-to-all too). When the tokens are not split over 'expert', each device runs its
  experts on its tokens and the partial outputs are summed over 'expert' outside the shard_map.
  """
  _check_experts(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd, impl)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return _routed_local(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd, impl, settings)
  token_axes, expert_axis = shard_layout(x_td.shape[0], w_gate_edf.shape[0], token_axes)
  gather = expert_axis is not None and expert_axis in token_axes

  def per_shard(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd):
    if expert_axis is None:
      return _routed_local(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd, impl, settings)
    if gather:
      x_td, weights_tk, experts_tk = (
        jax.lax.all_gather(a, expert_axis, axis=0, tiled=True) for a in (x_td, weights_tk, experts_tk)
      )
    first = jax.lax.axis_index(expert_axis) * w_gate_edf.shape[0]
    y_td = _routed_local(
      x_td,
      weights_tk,
      experts_tk,
      w_gate_edf,
      w_up_edf,
      w_down_efd,
      impl,
      settings,
      first_expert=first,
      all_local=False,
    )
    if gather:
      return jax.lax.psum_scatter(y_td, expert_axis, scatter_dimension=0, tiled=True)
    return y_td[None]

  tokens = P(_spec_entry(token_axes), None)
  experts = P(expert_axis, None, None)
  out = tokens if expert_axis is None or gather else P(expert_axis, _spec_entry(token_axes), None)
  # check_vma=False: the kernels' outputs carry no varying-axes type; every collective here is
  # transposed exactly without it (no psum of a replicated value).
  y = jax.shard_map(
    per_shard, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts), out_specs=out, check_vma=False
  )(x_td, weights_tk, experts_tk, w_gate_edf, w_up_edf, w_down_efd)
  return y if expert_axis is None or gather else jnp.sum(y, axis=0)


# ----------------------------------------------------------------------------- balancing, statistics


def expert_load(experts_tk, num_experts: int):
  """[E] float32: how many (token, k) rows chose each expert (exact integer counts)."""
  return _counts(experts_tk.reshape(-1), num_experts).astype(jnp.float32)


def update_bias(bias_e, load_e, *, rate: float = 1e-3, centred: bool = False):
  """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2), after each step over the global batch's
  loads [E]: b_i += rate * sign(mean_j load_j - load_i) (an overloaded expert's bias falls).
  centred=True is Moonlight's form: b_i += rate * (e_i - mean_j e_j), e_i = sign(mean load -
  load_i), which keeps the mean bias fixed. float32 in and out; no gradient."""
  if bias_e.shape != load_e.shape or bias_e.ndim != 1:
    raise ValueError(f'update_bias: bias and load must both be [E]; got {_fmt(bias_e.shape)} and {_fmt(load_e.shape)}')
  load_e = jax.lax.stop_gradient(load_e.astype(jnp.float32))
  step_e = jnp.sign(jnp.mean(load_e) - load_e)
  if centred:
    step_e = step_e - jnp.mean(step_e)
  return (bias_e.astype(jnp.float32) + rate * step_e).astype(jnp.float32)


def _normalised(scores_te):
  return scores_te / jnp.sum(scores_te, axis=-1, keepdims=True)


def sequence_balance_loss(scores_bte, experts_btk, *, alpha: float):
  """DeepSeek-V3's complementary sequence-wise balance loss (§2.1.2, eq. 17-20), averaged over the
  B sequences of T tokens: alpha * sum_i f_i P_i with f_i = E / (K T) * #{t : i in K_t} (no
  gradient) and P_i = (1 / T) sum_t s'_ti, s'_t = s_t / sum_j s_tj (the normalised scores).
  scores_bte float32 [B, T, E], experts_btk [B, T, K]. A balanced sequence gives alpha. 0.0
  when alpha is 0."""
  if scores_bte.ndim != 3 or experts_btk.shape[:2] != scores_bte.shape[:2]:
    raise ValueError(
      f'sequence_balance_loss expects scores [B, T, E] and experts [B, T, K]; got '
      f'{_fmt(scores_bte.shape)} and {_fmt(experts_btk.shape)}'
    )
  if not alpha:
    return jnp.zeros((), jnp.float32)
  _, t, e = scores_bte.shape
  k = experts_btk.shape[-1]
  counts_be = _counts(experts_btk.reshape(experts_btk.shape[0], -1), e)
  f_be = jax.lax.stop_gradient(counts_be.astype(jnp.float32) * (e / (k * t)))
  p_be = jnp.mean(_normalised(scores_bte.astype(jnp.float32)), axis=1)
  return alpha * jnp.mean(jnp.sum(f_be * p_be, axis=-1))


def router_entropy(scores_te):
  """Mean over tokens of the entropy (nats) of the normalised scores s_t / sum_j s_tj; log E when
  uniform. float32 scalar, no gradient."""
  p = _normalised(jax.lax.stop_gradient(scores_te).astype(jnp.float32))
  return -jnp.mean(jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1))


def router_stats(load_e, bias_e=None, entropy=None) -> dict:
  """Scalars for the metrics of one MoE layer, float32: load_max_over_mean (1 when balanced),
  load_cv (std / mean of the loads, population std), and with the bias bias_min, bias_max and
  bias_range (max - min); with entropy (router_entropy) router_entropy."""
  load_e = jnp.asarray(load_e, jnp.float32)
  mean = jnp.mean(load_e)
  stats = {'load_max_over_mean': jnp.max(load_e) / mean, 'load_cv': jnp.std(load_e) / mean}
  if bias_e is not None:
    stats.update(bias_min=jnp.min(bias_e), bias_max=jnp.max(bias_e), bias_range=jnp.max(bias_e) - jnp.min(bias_e))
  if entropy is not None:
    stats['router_entropy'] = jnp.asarray(entropy, jnp.float32)
  return stats
