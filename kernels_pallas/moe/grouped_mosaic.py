"""The MoE routed experts' grouped matmuls as Pallas Mosaic GPU kernels (Hopper: TMA loads into
shared memory, pipelined over the contraction, wgmma into a float32 accumulator, TMA stores), over
the padded layout of kimijax/ops/moe.py that grouped.py's Triton kernels use: each expert's (token,
k) rows in consecutive slots padded to whole tiles of block_m rows, tile i belonging to expert
expert_t[i] (E for the trailing tiles past the last expert, whose rows are all zero).

    tile_matmul(a [slots, K], w [E, K, N], expert_t)          -> [slots, N]  a_tile @ w[e]
    tile_matmul(a [slots, K], w [E, N, K], expert_t, transpose=True) -> [slots, N]  a_tile @ w[e]^T
    gate_up_swiglu(x [slots, D], w_in [E, D, 2F], expert_t)   -> gate|up [slots, 2F], h [slots, F]
    expert_weight_grad(a [slots, K], b [slots, N], expert_t, E) -> [E, K, N] float32, sum of a_tile^T b_tile
                                                                  over each expert's tiles
    down_swiglu_backward(g [slots, D], w_down [E, F, D], gate|up, w [slots], expert_t)
                                      -> d gate|up [slots, 2F], w h [slots, F], <u, h> [slots] float32

The first four are grouped.py's functions, arguments and results (the op picks the module by its
settings' type); the fifth, only here, fuses the backward's u = g W_down^T with SwiGLU's backward
(MosaicMoeSettings.fused_backward). With MosaicMoeSettings.consumers=2, tile_matmul and
gate_up_swiglu split each program between two consumer warpgroups fed by a producer warpgroup
(_consumer_tiles). A trailing tile's pipeline runs no step, so its output is zero
whatever its rows hold, and an expert without rows gets a zero weight gradient. Operands bf16 or
f16 (wgmma's 16-bit inputs); every product accumulates in float32. Off an NVIDIA GPU the kernels
run in Mosaic GPU's interpret mode. See README.md here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas.common import power_of_two_divisor
from kernels_pallas.moe.grouped import expert_tiles
from kimijax.ops.moe import swiglu, swiglu_backward

F32 = jnp.float32
DTYPES = (jnp.bfloat16, jnp.float16)
MIN_TILE = 64  # 128 bytes of a 16-bit row: the swizzled shared-memory tile the kernels load
MAX_TILES = 65535  # the CUDA grid's y dimension, which the tiles take (the last grid axis is x)


def _tile(dim: int, block: int, what: str) -> int:
  """The largest power of two <= block dividing dim, at least MIN_TILE (else a ValueError naming `what`)."""
  size = power_of_two_divisor(dim, block)
  if size < MIN_TILE:
    raise ValueError(f'moe mosaic: {what} ({dim}) must be a multiple of {MIN_TILE}')
  return size


def _slot_tiles(slots: int, bm: int) -> int:
  """The tiles of block_m=bm slots (a ValueError when they do not fit the slots or a grid)."""
  if slots % bm:
    raise ValueError(f'moe mosaic: the slots ({slots}) must be a multiple of block_m={bm}')
  if slots // bm > MAX_TILES:
    raise ValueError(
      f'moe mosaic: {slots} slots make {slots // bm} tiles of block_m={bm}, more than a grid holds ({MAX_TILES}); '
      'raise block_m or split the tokens'
    )
  return slots // bm


SMEM_BYTES = 227 * 1024  # shared memory a Hopper block may hold


def _fitting_stages(stages: int, stage_bytes: int, smem_bytes: int = SMEM_BYTES) -> int:
  """`stages`, or fewer (at least 2) when that many pipeline buffers of stage_bytes would overflow
  smem_bytes of shared memory."""
  return max(2, min(stages, smem_bytes // stage_bytes))


def _check_dtypes(*arrays):
  for a in arrays:
    if a.dtype not in DTYPES:
      raise ValueError(f'moe mosaic: operands must be bfloat16 or float16 (wgmma), got {a.dtype}')


def _call(body, out_type, grid, names, interpret, consumers=1):
  """The kernel over `grid`; with consumers=2, three warpgroups per program (_consumer_tiles)."""
  threads = {} if consumers == 1 else {'num_threads': consumers + 1, 'thread_name': 'wg'}
  return plgpu.kernel(
    body,
    out_type=out_type,
    grid=grid,
    grid_names=names,
    compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    interpret=plgpu.InterpretGPUParams() if interpret else None,
    **threads,
  )


def _write_through(smems, tiles, dests):
  """Each register tile into its shared-memory buffer, then to its global-memory window (TMA)."""
  for smem, tile in zip(smems, tiles):
    smem[...] = tile
  plgpu.commit_smem()
  for smem, dest in zip(smems, dests):
    plgpu.copy_smem_to_gmem(smem, dest)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _store(tiles, dests):
  """Each register tile through its own shared-memory buffer to its global-memory window."""
  pl.run_scoped(lambda *smems: _write_through(smems, tiles, dests), *(plgpu.SMEM(t.shape, t.dtype) for t in tiles))


def _consumer_tiles(consumers, stages, *, steps, in_specs, refs, mma, acc_shapes, out_tiles, epilogue):
  """One program's pipelined accumulation over `stages` buffers and its epilogue, on `consumers`
  warpgroups.

  consumers=1: one warpgroup issues the TMA loads and the wgmma (emit_pipeline). consumers=2: a
  third, producer warpgroup issues the loads (emit_pipeline_warp_specialized) and two consumer
  warpgroups share each loaded block, each computing its own part. mma(wg, *smem_blocks, *acc_refs)
  issues consumer wg's wgmma for one step; acc_shapes are one consumer's float32 accumulators;
  epilogue(wg, *acc_values) -> (tiles, dests), the tiles stored (TMA) through shared-memory buffers
  of out_tiles' (shape, dtype), one set per consumer. The buffers are released one step late
  (delay_release=1): a wgmma waits for the one before it, and the two-consumer step waits for all
  but its own (one group per accumulator) before the producer may refill the previous step's."""
  if consumers == 1:

    def accumulate(*acc_refs):
      def step(_, *smems):
        mma(0, *smems, *acc_refs)

      plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs, max_concurrent_steps=stages)(*refs)
      return tuple(acc_ref[...] for acc_ref in acc_refs)

    _store(*epilogue(0, *pl.run_scoped(accumulate, *(plgpu.ACC(shape) for shape in acc_shapes))))
    return

  # the consumers' output buffers live beside the pipeline's: fewer stages where both would overflow
  out_bytes = consumers * sum(math.prod(shape) * jnp.dtype(dtype).itemsize for shape, dtype in out_tiles)
  stage_bytes = sum(math.prod(spec.block_shape) * ref.dtype.itemsize for spec, ref in zip(in_specs, refs))
  stages = _fitting_stages(stages, stage_bytes, SMEM_BYTES - out_bytes)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps,),
      memory_registers=40,
      in_specs=in_specs,
      wg_axis='wg',
      num_compute_wgs=consumers,
      max_concurrent_steps=stages,
      compute_context=context,
    )

  def scope(allocations, *out_smems):
    wg = jax.lax.axis_index('wg')

    def context(run_pipeline):
      def with_accumulators(*acc_refs):
        run_pipeline(acc_refs)
        tiles, dests = epilogue(wg, *(acc_ref[...] for acc_ref in acc_refs))
        _write_through([smem.at[wg] for smem in out_smems], tiles, dests)

      pl.run_scoped(with_accumulators, *(plgpu.ACC(shape) for shape in acc_shapes))

    def step(_, *args):
      *smems, acc_refs = args
      mma(wg, *smems, *acc_refs)
      plgpu.wgmma_wait(len(acc_refs))
      return acc_refs

    pipeline(step, context)(*refs, allocations=allocations)

  unused = lambda *_, **__: None
  pl.run_scoped(
    scope,
    pipeline(unused, unused).get_allocations(*refs),
    *(plgpu.SMEM((consumers, *shape), dtype) for shape, dtype in out_tiles),
    collective_axes='wg',
  )


def _consumers(n: int, tile: int, consumers: int) -> int:
  """The consumer warpgroups a program of `consumers` x `tile` columns of n can use: 1 where n
  holds a single tile."""
  return consumers if n % (consumers * tile) == 0 else 1


def _expert_steps(expert_gmem, tile, num_experts: int, steps: int):
  """(the tile's expert, clamped to the last for a trailing tile; its pipeline's steps: `steps`,
  none for a trailing tile)."""
  expert = expert_gmem[tile]
  return jnp.minimum(expert, num_experts - 1), jnp.where(expert < num_experts, jnp.int32(steps), jnp.int32(0))


@functools.partial(jax.jit, static_argnames=('transpose', 'out_dtype', 'settings', 'interpret'))
def tile_matmul(a_pk, w_ekn, expert_t, *, transpose=False, out_dtype=None, settings, interpret=False):
  """[slots, N] in out_dtype (None: a's): each tile of block_m slots times its expert's matrix, w
  [E, K, N] (or, transpose=True, w [E, N, K] used as its transpose); zero in trailing tiles. One
  program per (tile, consumers x block_n columns); the K loop pipelined over settings.stages
  buffers."""
  _check_dtypes(a_pk, w_ekn)
  slots, k = a_pk.shape
  e = w_ekn.shape[0]
  n = w_ekn.shape[1] if transpose else w_ekn.shape[2]
  bm = settings.block_m
  tiles = _slot_tiles(slots, bm)
  bk, bn = _tile(k, settings.block_k, 'the contraction dim'), _tile(n, settings.block_n, 'the output dim')
  c = _consumers(n, bn, settings.consumers)
  out_dtype = out_dtype or a_pk.dtype

  def body(expert_gmem, a_gmem, w_gmem, o_gmem):
    mi, ni = jax.lax.axis_index('m'), jax.lax.axis_index('n')
    expert, steps = _expert_steps(expert_gmem, mi, e, k // bk)

    def mma(wg, a_smem, w_smem, acc_ref):
      if c > 1:  # this consumer's columns of the weight block
        w_smem = w_smem.at[pl.ds(wg * bn, bn)] if transpose else w_smem.at[:, pl.ds(wg * bn, bn)]
      plgpu.wgmma(acc_ref, a_smem, w_smem.T if transpose else w_smem)

    def epilogue(wg, acc):
      return [acc.astype(out_dtype)], [o_gmem.at[pl.ds(mi * bm, bm), pl.ds((ni * c + wg) * bn, bn)]]

    w_spec = (
      plgpu.BlockSpec((c * bn, bk), lambda kk: (ni, kk), delay_release=1)
      if transpose
      else plgpu.BlockSpec((bk, c * bn), lambda kk: (kk, ni), delay_release=1)
    )
    _consumer_tiles(
      c,
      settings.stages,
      steps=steps,
      in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), delay_release=1), w_spec],
      refs=(a_gmem, w_gmem.at[expert]),
      mma=mma,
      acc_shapes=[(bm, bn)],
      out_tiles=[((bm, bn), out_dtype)],
      epilogue=epilogue,
    )

  out = jax.ShapeDtypeStruct((slots, n), out_dtype)
  grid = (tiles, n // (c * bn))
  return _call(body, out, grid, ('m', 'n'), interpret, c)(expert_t.astype(jnp.int32), a_pk, w_ekn)


@functools.partial(jax.jit, static_argnames=('settings', 'interpret'))
def gate_up_swiglu(x_pd, w_in_ed2f, expert_t, *, settings, interpret=False):
  """(gate|up [slots, 2F], h = silu(gate) * up [slots, F]), both in x's dtype: one program per
  (tile, consumers x block_f hidden columns), each consumer holding its gate and up accumulators
  over one pipelined loop on D, h in float32 from the rounded gate and up (as the backward
  recomputes it). Zero in trailing tiles."""
  _check_dtypes(x_pd, w_in_ed2f)
  slots, d = x_pd.shape
  e, _, f2 = w_in_ed2f.shape
  f = f2 // 2
  bm = settings.block_m
  tiles = _slot_tiles(slots, bm)
  bk, bf = _tile(d, settings.block_k, 'd_model'), _tile(f, settings.block_f, 'the expert hidden width')
  c = _consumers(f, bf, settings.consumers)
  dtype, nf = x_pd.dtype, f // (c * bf)

  def body(expert_gmem, x_gmem, w_gmem, gate_up_gmem, h_gmem):
    mi, ni = jax.lax.axis_index('m'), jax.lax.axis_index('n')
    expert, steps = _expert_steps(expert_gmem, mi, e, d // bk)
    w_e = w_gmem.at[expert]

    def mma(wg, x_smem, gate_smem, up_smem, gate_ref, up_ref):
      if c > 1:  # this consumer's columns of the gate and up blocks
        gate_smem, up_smem = gate_smem.at[:, pl.ds(wg * bf, bf)], up_smem.at[:, pl.ds(wg * bf, bf)]
      plgpu.wgmma(gate_ref, x_smem, gate_smem)
      plgpu.wgmma(up_ref, x_smem, up_smem)

    def epilogue(wg, gate, up):
      gate, up = gate.astype(dtype), up.astype(dtype)
      h = swiglu(gate.astype(F32), up.astype(F32)).astype(dtype)
      rows, col = pl.ds(mi * bm, bm), (ni * c + wg) * bf
      dests = [
        gate_up_gmem.at[rows, pl.ds(col, bf)],
        gate_up_gmem.at[rows, pl.ds(f + col, bf)],
        h_gmem.at[rows, pl.ds(col, bf)],
      ]
      return [gate, up, h], dests

    _consumer_tiles(
      c,
      settings.stages,
      steps=steps,
      in_specs=[
        plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), delay_release=1),
        plgpu.BlockSpec((bk, c * bf), lambda kk: (kk, ni), delay_release=1),
        plgpu.BlockSpec((bk, c * bf), lambda kk: (kk, nf + ni), delay_release=1),
      ],
      refs=(x_gmem, w_e, w_e),
      mma=mma,
      acc_shapes=[(bm, bf), (bm, bf)],
      out_tiles=[((bm, bf), dtype)] * 3,
      epilogue=epilogue,
    )

  out = (jax.ShapeDtypeStruct((slots, f2), dtype), jax.ShapeDtypeStruct((slots, f), dtype))
  return _call(body, out, (tiles, nf), ('m', 'n'), interpret, c)(expert_t.astype(jnp.int32), x_pd, w_in_ed2f)


@functools.partial(jax.jit, static_argnames=('num_experts', 'settings', 'interpret'))
def expert_weight_grad(a_pk, b_pn, expert_t, *, num_experts, settings, interpret=False):
  """[E, K, N] float32: for each expert the sum over its tiles of a_tile^T b_tile (zero for an
  expert with no tile); one program per (expert, K tile, N tile of block_n) runs a pipelined loop
  over its expert's tiles (a traced trip count), so each output tile is written once."""
  _check_dtypes(a_pk, b_pn)
  slots, k = a_pk.shape
  n = b_pn.shape[1]
  bm = settings.block_m
  _slot_tiles(slots, bm)
  bk, bn = _tile(k, settings.block_n, 'the weight rows'), _tile(n, settings.block_n, 'the weight columns')
  first_e, count_e = expert_tiles(expert_t.astype(jnp.int32), num_experts)
  stages = _fitting_stages(settings.stages, bm * (bk + bn) * a_pk.dtype.itemsize)

  def body(first_gmem, count_gmem, a_gmem, b_gmem, o_gmem):
    ei, ki, ni = jax.lax.axis_index('e'), jax.lax.axis_index('k'), jax.lax.axis_index('n')
    first = first_gmem[ei]

    def mma(_, a_smem, b_smem, acc_ref):
      plgpu.wgmma(acc_ref, a_smem.T, b_smem)

    def epilogue(_, acc):
      return [acc], [o_gmem.at[ei, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)]]

    _consumer_tiles(
      1,
      stages,
      steps=count_gmem[ei],
      in_specs=[
        plgpu.BlockSpec((bm, bk), lambda t: (first + t, ki), delay_release=1),
        plgpu.BlockSpec((bm, bn), lambda t: (first + t, ni), delay_release=1),
      ],
      refs=(a_gmem, b_gmem),
      mma=mma,
      acc_shapes=[(bk, bn)],
      out_tiles=[((bk, bn), F32)],
      epilogue=epilogue,
    )

  out = jax.ShapeDtypeStruct((num_experts, k, n), F32)
  grid = (num_experts, k // bk, n // bn)
  return _call(body, out, grid, ('e', 'k', 'n'), interpret)(first_e, count_e, a_pk, b_pn)


@functools.partial(jax.jit, static_argnames=('settings', 'interpret'))
def down_swiglu_backward(g_pd, w_down_efd, gate_up_p2f, w_p, expert_t, *, settings, interpret=False):
  """The down projection's input gradient fused with SwiGLU's backward, per (tile, F tile of
  block_f): u = g_tile @ W_down[e]^T in float32, then with h = silu(gate) * up from the saved
  gate|up and each slot's mixing weight w_p [slots] float32 (zero in padding):
  (d gate|up [slots, 2F] = SwiGLU's backward of dh = w u, w h [slots, F], both in g's dtype;
  <u, h> [slots] float32, each row's sum over F). u never reaches global memory."""
  _check_dtypes(g_pd, w_down_efd, gate_up_p2f)
  slots, d = g_pd.shape
  e, f, _ = w_down_efd.shape
  bm = settings.block_m
  tiles = _slot_tiles(slots, bm)
  bk, bf = _tile(d, settings.block_k, 'd_model'), _tile(f, settings.block_f, 'the expert hidden width')
  dtype, nf = g_pd.dtype, f // bf

  def body(expert_gmem, g_gmem, w_gmem, gate_up_gmem, w_p_gmem, d_gate_up_gmem, wh_gmem, uh_gmem):
    mi, ni = jax.lax.axis_index('m'), jax.lax.axis_index('n')
    expert, steps = _expert_steps(expert_gmem, mi, e, d // bk)
    rows = pl.ds(mi * bm, bm)

    def epilogue_inputs(gate_smem, up_smem, w_smem, barriers):
      # the epilogue's operands load (TMA) while the pipeline runs
      plgpu.copy_gmem_to_smem(gate_up_gmem.at[rows, pl.ds(ni * bf, bf)], gate_smem, barriers.at[0])
      plgpu.copy_gmem_to_smem(gate_up_gmem.at[rows, pl.ds(f + ni * bf, bf)], up_smem, barriers.at[1])
      plgpu.copy_gmem_to_smem(w_p_gmem.at[rows], w_smem, barriers.at[2])

      def accumulate(acc_ref):
        def step(_, g_smem, w_down_smem):
          plgpu.wgmma(acc_ref, g_smem, w_down_smem.T)

        plgpu.emit_pipeline(
          step,
          grid=(steps,),
          in_specs=[
            plgpu.BlockSpec((bm, bk), lambda kk: (mi, kk), delay_release=1),
            plgpu.BlockSpec((bf, bk), lambda kk: (ni, kk), delay_release=1),
          ],
          max_concurrent_steps=settings.stages,
        )(g_gmem, w_gmem.at[expert])
        return acc_ref[...]

      u = pl.run_scoped(accumulate, plgpu.ACC((bm, bf)))
      for i in range(3):
        plgpu.barrier_wait(barriers.at[i])
      gate, up = gate_smem[...].astype(F32), up_smem[...].astype(F32)
      w = jax.lax.broadcast_in_dim(w_smem[...], (bm, bf), [0])
      d_gate, d_up, h = swiglu_backward(gate, up, w * u)
      return d_gate.astype(dtype), d_up.astype(dtype), (w * h).astype(dtype), jnp.sum(u * h, axis=1)

    scratch = (plgpu.SMEM((bm, bf), dtype), plgpu.SMEM((bm, bf), dtype), plgpu.SMEM((bm,), F32))
    d_gate, d_up, wh, uh = pl.run_scoped(epilogue_inputs, *scratch, plgpu.Barrier(num_barriers=3))
    _store(
      [d_gate, d_up, wh, uh],
      [
        d_gate_up_gmem.at[rows, pl.ds(ni * bf, bf)],
        d_gate_up_gmem.at[rows, pl.ds(f + ni * bf, bf)],
        wh_gmem.at[rows, pl.ds(ni * bf, bf)],
        uh_gmem.at[ni, rows],
      ],
    )

  out = (
    jax.ShapeDtypeStruct((slots, 2 * f), dtype),
    jax.ShapeDtypeStruct((slots, f), dtype),
    jax.ShapeDtypeStruct((nf, slots), F32),
  )
  call = _call(body, out, (tiles, nf), ('m', 'n'), interpret)
  d_gate_up, wh, uh_parts = call(expert_t.astype(jnp.int32), g_pd, w_down_efd, gate_up_p2f, w_p.astype(F32))
  return d_gate_up, wh, jnp.sum(uh_parts, axis=0)
