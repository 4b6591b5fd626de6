"""Triton settings of the MLA decode kernel (decode.py). bench_mla_decode takes any of them as
--tiles=key=int/key=int, the config as model.kernels.mla_decode; the op takes them as
`mla_decode(..., impl='pallas', settings=MlaDecodeSettings(...))`. The defaults are the measured
ones (experiments/results/bench_mla_decode.md); other values are untimed."""

from __future__ import annotations

import dataclasses

from kernels_pallas.settings import Settings


@dataclasses.dataclass(frozen=True)
class MlaDecodeSettings(Settings):
  """Cache rows per block (block_s, a power of two >= 16); programs, how many programs (batch x head
  blocks x context splits) the kernel runs at most: the splits per sequence are as many as fit
  (at least one, at most one per block_s rows of the cache), so that all programs run at once
  rather than a few of them in a last wave; query heads per program (heads, a power of two >= 16:
  the dots' rows); Triton warps and pipelining stages."""

  FAMILY = 'mla_decode pallas'

  block_s: int = 64
  programs: int = 264  # 132 SMs of an H200, 2 programs resident on each at the default tiles
  heads: int = 16
  warps: int = 4
  stages: int = 2

  def __post_init__(self):
    super().__post_init__()
    self._check_powers_of_two(('block_s', 'heads'), 16)

  def splits(self, batch: int, head_blocks: int, max_len: int) -> int:
    """Context splits per (sequence, head block): as many as `programs` allows, at least one, at most
    one per block_s rows of the cache."""
    return max(1, min(self.programs // (batch * head_blocks), -(-max_len // self.block_s)))
