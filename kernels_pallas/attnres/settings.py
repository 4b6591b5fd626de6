"""Triton settings of the Block AttnRes kernels, measured on an H200 at S = 6 and n = 8, the grads
kernel also at n = 3, 4, 5 (experiments/results/bench_attnres.md). Benchmarks take them as
--phase1_tiles / --merge_tiles ('key=int/key=int'), the config as model.kernels.attnres_phase1 and
model.kernels.attnres_merge_norm; the ops as `phase1(..., impl='pallas', settings=...)` and
`merge_norm(..., impl='pallas', settings=...)`."""

from __future__ import annotations

import dataclasses

from kernels_pallas.settings import Settings


@dataclasses.dataclass(frozen=True)
class Phase1Settings(Settings):
  """Phase 1 (phase1.py), per kernel: rows per tile (bt), features per chunk (dc, a power of two),
  warps and Triton pipeline stages. A grads program covers rows_grads rows in steps of bt_grads;
  the logits and vdo kernels hold whole rows, dc features at a time. rows_grads and bt_logits are
  a dot's dimension: >= 16."""

  FAMILY = 'attnres phase1'

  # combine
  bt: int = 16
  dc: int = 128
  warps: int = 4
  stages: int = 2
  bt_grads: int = 8
  rows_grads: int = 128
  dc_grads: int = 128
  warps_grads: int = 4
  stages_grads: int = 2
  bt_vdo: int = 16
  dc_vdo: int = 64
  warps_vdo: int = 4
  stages_vdo: int = 2
  bt_logits: int = 64
  dc_logits: int = 128
  warps_logits: int = 4
  stages_logits: int = 2

  def __post_init__(self):
    super().__post_init__()
    if min(self.rows_grads, self.bt_logits) < 16:
      raise ValueError(
        f"{self.FAMILY}: settings rows_grads and bt_logits are a dot's dimension and must "
        f'be >= 16; got {self.rows_grads} and {self.bt_logits}'
      )
    if self.rows_grads % self.bt_grads:
      raise ValueError(f'{self.FAMILY}: setting bt_grads ({self.bt_grads}) must divide rows_grads ({self.rows_grads})')


@dataclasses.dataclass(frozen=True)
class MergeNormSettings(Settings):
  """Phase 2 fused with the pre-norm (merge_norm.py): bt rows per tile, held in registers as
  feature chunks of dc (D itself when D is a power of two <= dc; the chunk loads must be powers of
  two); `groups` tiles per backward program; warps and Triton pipeline stages."""

  FAMILY = 'attnres merge_norm'

  bt: int = 2
  dc: int = 1024
  warps: int = 4
  stages: int = 2
  groups: int = 8
