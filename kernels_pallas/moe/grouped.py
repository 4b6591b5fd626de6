"""The MoE routed experts' grouped matmuls as Pallas (Triton) kernels over the padded layout of
kimijax/ops/moe.py: each expert's (token, k) rows in consecutive slots padded to whole tiles of
block_m rows, tile i belonging to expert expert_t[i] (E for the trailing tiles past the last
expert, whose rows are all padding). The weights are read in place, the tile's expert loaded as a
scalar: no per-tile copy of a weight matrix.

    tile_matmul(a [slots, K], w [E, K, N], expert_t)          -> [slots, N]  a_tile @ w[e]
    tile_matmul(a [slots, K], w [E, N, K], expert_t, transpose=True) -> [slots, N]  a_tile @ w[e]^T
    gate_up_swiglu(x [slots, D], w_in [E, D, 2F], expert_t)   -> gate|up [slots, 2F], h [slots, F]
    expert_weight_grad(a [slots, K], b [slots, N], expert_t, E) -> [E, K, N] float32, sum of a_tile^T b_tile
                                                                  over each expert's tiles

Every dot accumulates in float32. See README.md in this folder for the grids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kernels_pallas.common import compiler_params, power_of_two_divisor
from kimijax.ops.moe import swiglu

F32 = jnp.float32
MIN_TILE = 16  # the dots' smallest side


def tile_size(dim: int, block: int, name: str) -> int:
  """The largest power of two <= block dividing dim, at least MIN_TILE (else a ValueError naming `name`)."""
  size = power_of_two_divisor(dim, block)
  if size < MIN_TILE:
    raise ValueError(f'moe pallas: {name} ({dim}) must be a multiple of {MIN_TILE}')
  return size


def _dot_t(a, b):
  """a [M, K] . b [N, K]^T -> [M, N] float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _dot_tn(a, b):
  """a [R, K]^T . b [R, N] -> [K, N] float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _steps(expert, num_experts: int, total: int, block_k: int):
  """The contraction chunks of a tile: none for a trailing tile (expert E), whose output is zero.
  The counts are typed int32: the Triton lowering of jnp.where gives two weakly typed Python ints
  the condition's type (i1), which leaves the loop's bounds of different types (IR that does not
  verify)."""
  return jnp.where(expert < num_experts, jnp.int32(total // block_k), jnp.int32(0))


def _tile_matmul_kernel(expert_ref, a_ref, w_ref, o_ref, *, num_experts, block_k, transpose):
  expert = expert_ref[0]
  block_n = o_ref.shape[1]
  n0 = pl.program_id(1) * block_n

  def body(i, acc):
    k0 = pl.multiple_of(i * block_k, block_k)
    a = a_ref[:, pl.ds(k0, block_k)]
    if transpose:
      return acc + _dot_t(a, w_ref[expert, pl.ds(n0, block_n), pl.ds(k0, block_k)])
    return acc + jnp.dot(a, w_ref[expert, pl.ds(k0, block_k), pl.ds(n0, block_n)], preferred_element_type=F32)

  steps = _steps(expert, num_experts, a_ref.shape[1], block_k)
  acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(o_ref.shape, F32))
  o_ref[...] = acc.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=('transpose', 'out_dtype', 'settings', 'interpret'))
def tile_matmul(a_pk, w_ekn, expert_t, *, transpose=False, out_dtype=None, settings, interpret=False):
  """[slots, N] in out_dtype (None: a's): each tile of block_m slots times its expert's matrix,
  w [E, K, N] (or, transpose=True, w [E, N, K] used as its transpose); zero in trailing tiles.
  a and w in one dtype; slots a multiple of settings.block_m, K and N multiples of 16."""
  slots, k = a_pk.shape
  e = w_ekn.shape[0]
  n = w_ekn.shape[1] if transpose else w_ekn.shape[2]
  bm = settings.block_m
  bk, bn = tile_size(k, settings.block_k, 'the contraction dim'), tile_size(n, settings.block_n, 'the output dim')
  return pl.pallas_call(
    functools.partial(_tile_matmul_kernel, num_experts=e, block_k=bk, transpose=transpose),
    grid=(slots // bm, n // bn),
    in_specs=[
      pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
      pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
      pl.BlockSpec(w_ekn.shape, lambda i, j: (0, 0, 0)),
    ],
    out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
    out_shape=jax.ShapeDtypeStruct((slots, n), out_dtype or a_pk.dtype),
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='moe_tile_matmul',
  )(expert_t.astype(jnp.int32)[:, None], a_pk, w_ekn)


def _gate_up_kernel(expert_ref, x_ref, w_ref, gate_up_ref, h_ref, *, num_experts, block_k, hidden):
  expert = expert_ref[0]
  block_f = h_ref.shape[1]
  f0 = pl.program_id(1) * block_f

  def body(i, accs):
    gate, up = accs
    k0 = pl.multiple_of(i * block_k, block_k)
    x = x_ref[:, pl.ds(k0, block_k)]
    gate += jnp.dot(x, w_ref[expert, pl.ds(k0, block_k), pl.ds(f0, block_f)], preferred_element_type=F32)
    up += jnp.dot(x, w_ref[expert, pl.ds(k0, block_k), pl.ds(hidden + f0, block_f)], preferred_element_type=F32)
    return gate, up

  steps = _steps(expert, num_experts, x_ref.shape[1], block_k)
  zeros = jnp.zeros(h_ref.shape, F32)
  gate, up = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
  gate, up = gate.astype(gate_up_ref.dtype), up.astype(gate_up_ref.dtype)
  gate_up_ref[:, 0, :] = gate
  gate_up_ref[:, 1, :] = up
  # h from the rounded gate and up, as the backward recomputes it from the saved gate|up
  h_ref[...] = swiglu(gate.astype(F32), up.astype(F32)).astype(h_ref.dtype)


@functools.partial(jax.jit, static_argnames=('settings', 'interpret'))
def gate_up_swiglu(x_pd, w_in_ed2f, expert_t, *, settings, interpret=False):
  """(gate|up [slots, 2F], h = silu(gate) * up [slots, F]), both in x's dtype: gate|up = x_tile @
  w_in[e] (two float32 accumulators over one loop on D), h in float32 from the rounded gate and up.
  Zero in trailing tiles. x and w_in in one dtype; slots a multiple of settings.block_m, D and F
  multiples of 16."""
  slots, d = x_pd.shape
  e, _, f2 = w_in_ed2f.shape
  f = f2 // 2
  bm = settings.block_m
  bk, bf = tile_size(d, settings.block_k, 'd_model'), tile_size(f, settings.block_n, 'the expert hidden width')
  gate_up_p2f, h_pf = pl.pallas_call(
    functools.partial(_gate_up_kernel, num_experts=e, block_k=bk, hidden=f),
    grid=(slots // bm, f // bf),
    in_specs=[
      pl.BlockSpec((None, 1), lambda i, j: (i, 0)),
      pl.BlockSpec((bm, d), lambda i, j: (i, 0)),
      pl.BlockSpec(w_in_ed2f.shape, lambda i, j: (0, 0, 0)),
    ],
    out_specs=[pl.BlockSpec((bm, 2, bf), lambda i, j: (i, 0, j)), pl.BlockSpec((bm, bf), lambda i, j: (i, j))],
    out_shape=[jax.ShapeDtypeStruct((slots, 2, f), x_pd.dtype), jax.ShapeDtypeStruct((slots, f), x_pd.dtype)],
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='moe_gate_up_swiglu',
  )(expert_t.astype(jnp.int32)[:, None], x_pd, w_in_ed2f)
  return gate_up_p2f.reshape(slots, f2), h_pf


def _expert_grad_kernel(first_ref, count_ref, a_ref, b_ref, o_ref, *, block_m):
  first = first_ref[0]

  def body(i, acc):
    r0 = pl.multiple_of((first + i) * block_m, block_m)
    return acc + _dot_tn(a_ref[pl.ds(r0, block_m), :], b_ref[pl.ds(r0, block_m), :])

  o_ref[...] = jax.lax.fori_loop(0, count_ref[0], body, jnp.zeros(o_ref.shape, F32))


def expert_tiles(expert_t, num_experts: int):
  """(first tile, tiles) [E] int32 of each expert: its tiles are consecutive, experts in order."""
  count_e = jnp.sum(expert_t[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None], axis=1, dtype=jnp.int32)
  return jnp.cumsum(count_e) - count_e, count_e


@functools.partial(jax.jit, static_argnames=('num_experts', 'settings', 'interpret'))
def expert_weight_grad(a_pk, b_pn, expert_t, *, num_experts, settings, interpret=False):
  """[E, K, N] float32: for each expert the sum over its tiles of a_tile^T b_tile (zero for an
  expert with no tile); one program per (expert, K tile, N tile) walks its expert's tiles, so
  nothing is summed across programs. a and b in one dtype; slots a multiple of settings.block_m,
  K and N multiples of 16."""
  slots, k = a_pk.shape
  n = b_pn.shape[1]
  bm = settings.block_m
  tile_k = tile_size(k, settings.block_n, 'the weight rows')
  tile_n = tile_size(n, settings.block_n, 'the weight columns')
  first_e, count_e = expert_tiles(expert_t.astype(jnp.int32), num_experts)
  per_expert = pl.BlockSpec((None, 1), lambda e, i, j: (e, 0))
  return pl.pallas_call(
    functools.partial(_expert_grad_kernel, block_m=bm),
    grid=(num_experts, k // tile_k, n // tile_n),
    in_specs=[
      per_expert,
      per_expert,
      pl.BlockSpec((slots, tile_k), lambda e, i, j: (0, i)),
      pl.BlockSpec((slots, tile_n), lambda e, i, j: (0, j)),
    ],
    out_specs=pl.BlockSpec((None, tile_k, tile_n), lambda e, i, j: (e, i, j)),
    out_shape=jax.ShapeDtypeStruct((num_experts, k, n), F32),
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='moe_expert_weight_grad',
  )(first_e[:, None], count_e[:, None], a_pk, b_pn)
