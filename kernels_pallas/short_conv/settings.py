"""Triton settings of the short-conv kernels (conv.py), measured on an H200
(experiments/results/bench_kda.md). bench_kda and bench_train take any of them as
--conv_tiles=key=int/key=int, the config as model.kernels.short_conv; the op takes them as
`short_conv(..., impl='pallas', settings=ShortConvSettings(...))`."""

from __future__ import annotations

import dataclasses

from kernels_pallas.common import power_of_two_divisor
from kernels_pallas.settings import Settings


@dataclasses.dataclass(frozen=True)
class ShortConvSettings(Settings):
  """Rows (tokens) and heads per program, Triton warps and pipelining stages of the three kernels;
  short_conv_dz takes dz_tiles tiles of dz_rows rows per program (at most: powers of two dividing
  the padded T)."""

  FAMILY = 'short_conv pallas'

  rows: int = 32
  heads: int = 1
  warps: int = 8
  stages: int = 1
  dz_rows: int = 16
  dz_tiles: int = 32

  def dz_layout(self, tp: int) -> tuple[int, int]:
    """(rows per tile, row tiles per program) of short_conv_dz over tp (padded) tokens."""
    rows = power_of_two_divisor(tp, self.dz_rows)
    return rows, power_of_two_divisor(tp // rows, self.dz_tiles)
