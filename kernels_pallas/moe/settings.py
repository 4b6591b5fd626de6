"""Triton settings of the MoE grouped-matmul kernels (grouped.py). The config takes them as
model.kernels.moe; the op as `routed_experts(..., impl='pallas', settings=MoeSettings(...))`.
Compiled for sm_90 the defaults are the nearest settings at which no kernel spills registers (8
warps: at 4, gate_up_swiglu's two float32 accumulators alone fill the 255 registers of a thread);
timed on an H100 they run slower than 'xla_blocked', as do the single changes tried there
(experiments/results/moe.md)."""

from __future__ import annotations

import dataclasses

from kernels_pallas.settings import Settings


@dataclasses.dataclass(frozen=True)
class MoeSettings(Settings):
  """Rows per tile (block_m: also the padded layout's block, each expert's rows padded to whole
  tiles), output columns per program (block_n), the contraction chunk (block_k), each a power of
  two >= 16 (the dots' smallest side; block_n and block_k shrink to the largest power of two that
  divides the dim); Triton warps and pipelining stages."""

  FAMILY = 'moe pallas'

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  warps: int = 8
  stages: int = 3

  def __post_init__(self):
    super().__post_init__()
    self._check_powers_of_two(('block_m', 'block_n', 'block_k'), 16)


@dataclasses.dataclass(frozen=True)
class MosaicMoeSettings(Settings):
  """The Mosaic GPU kernels' (grouped_mosaic.py) tiles: rows per tile (block_m, also the padded
  layout's block), output columns per program (block_n; the weight gradient's K and N tiles),
  the contraction chunk (block_k), gate_up_swiglu's hidden columns per program (block_f: its two
  float32 accumulators), and the pipeline's buffers in flight (stages). block_m a multiple of 64
  (a warpgroup's wgmma rows); block_n, block_k and block_f shrink to the largest power of two that
  divides the dim they tile, at least 64 (so D and F must be multiples of 64). fused_backward 1:
  the backward's down-projection input gradient and SwiGLU's backward in one kernel
  (down_swiglu_backward; the default: the layer's forward+backward 4% faster on an H100,
  experiments/results/moe.md), 0: the tile matmul writes u in float32 and XLA runs SwiGLU's
  backward. consumers 2: tile_matmul and gate_up_swiglu run two consumer warpgroups per program,
  each on its own block_n (block_f) columns of a program twice as wide, beside a producer
  warpgroup that issues the TMA loads (a warp-specialized pipeline; slower on an H100,
  experiments/results/moe.md); 1: one warpgroup does both."""

  FAMILY = 'moe mosaic'

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  block_f: int = 64
  stages: int = 3
  fused_backward: int = 1
  consumers: int = 1

  SWITCHES = ('fused_backward',)

  def __post_init__(self):
    super().__post_init__()
    if self.block_m % 64:
      raise ValueError(f'{self.FAMILY}: block_m must be a multiple of 64, got {self.block_m}')
    self._check_powers_of_two(('block_n', 'block_k', 'block_f'), 64)
    if self.consumers not in (1, 2):
      raise ValueError(f'{self.FAMILY}: consumers must be 1 or 2, got {self.consumers}')
