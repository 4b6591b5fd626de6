"""Triton settings of the KDA kernels (op.py, step.py, decode.py), measured on an H200
(experiments/results/bench_kda.md). bench_kda and bench_train take any of them as
--kda_tiles=key=int/key=int, the config as model.kernels.kda; the op takes them as
`kda(..., impl='pallas', settings=KdaSettings(...))`."""

from __future__ import annotations

import dataclasses

from kernels_pallas.common import triton_params
from kernels_pallas.settings import Settings

# Shared memory per program on Hopper (227 KB), for state_stages.
SHARED_MEMORY = 227 * 1024


@dataclasses.dataclass(frozen=True)
class KdaSettings(Settings):
  """The KDA kernels' settings (defaults: the measured ones) and the rules that pick shape-dependent
  values from them (value_block, state_stages)."""

  FAMILY = 'kda pallas'
  SWITCHES = ('flat_branch', 'fused_gate', 'fused_decode')

  # warps per program of each kernel (the key after 'warps_' is what params is given)
  warps_cumsum: int = 2
  warps_reverse_cumsum: int = 4
  warps_diag: int = 8
  warps_scores: int = 2
  warps_wy: int = 2
  warps_apply: int = 8
  warps_state: int = 4
  warps_cotangents: int = 4
  warps_wy_bwd: int = 8
  warps_diag_bwd: int = 4
  warps_scores_bwd: int = 2
  # Triton pipelining stages of every kernel but the state passes (and the decode step)
  stages: int = 1
  # the state passes' chunk loop: 3 stages load the next chunks' w, u, kg (qg, aqk) as cp.async
  # copies while the current chunk's dots run (about 64 KB of shared memory per stage at
  # K = V = 128 in bf16; state_stages caps them). The backward is faster at one stage with 256
  # programs or more (the 4096 step: two programs per SM), at 3 with few (below).
  stages_state_fwd: int = 3
  stages_state_bwd: int = 1
  stages_state_bwd_few: int = 3
  # heads per program of the token-parallel kernels diag_fwd and diag_bwd
  heads_diag: int = 16
  heads_diag_bwd: int = 8
  # features per program of scores_bwd and of the forward and reverse cumulative sums
  features_bwd: int = 64
  features_cumsum: int = 32
  features_reverse_cumsum: int = 32
  # value columns per program of the state passes
  value_block: int = 64
  # below this many state-pass programs (B * H * V / value_block; 64 at (2, 16384, 16, 128), on
  # 132 SMs): the value block halves until there are that many (16 columns at least) and the
  # backward pass takes stages_state_bwd_few
  programs_few: int = 128
  # 1: when no sub-chunk of a call is steep (blocks.any_steep), skip the pairwise diagonal
  # kernels and run the scores kernels without their inputs (an XLA conditional); 0: always the
  # per-sub-chunk choice inside the kernels
  flat_branch: int = 1
  # 1: a gated call (a_log, dt_bias) forms the log-decay inside the cumulative-sum kernels;
  # 0: in XLA before them
  fused_gate: int = 1
  # 1: a KDA layer's decode token runs as one kernel (decode.py: convs, activations, gates and the
  # step); 0: the convs, activations and gates in XLA, then the step kernel (step.py)
  fused_decode: int = 1
  # the decode kernels (step.py, decode.py): warps, stages and value columns per program
  warps_step: int = 4
  stages_step: int = 1
  value_block_step: int = 64

  def params(self, kernel: str, stages: int | None = None):
    """Triton's compiler parameters of `kernel`: warps_<kernel> warps and `stages` pipelining
    stages (default the `stages` field)."""
    return triton_params(getattr(self, 'warps_' + kernel), stages or self.stages)

  def few_programs(self, b: int, h: int, dv: int, bv: int | None = None) -> bool:
    """Whether the state passes have fewer than programs_few programs at value block bv (default
    the value_block field)."""
    return b * h * (dv // (bv or min(dv, self.value_block))) < self.programs_few

  def state_value_block(self, b: int, h: int, dv: int) -> int:
    """Value columns per program of the state passes: value_block, halved (16 at least) while that
    leaves fewer than programs_few programs. The state's value columns evolve independently, so
    any block gives the same result."""
    bv = min(dv, self.value_block)
    while bv > 16 and self.few_programs(b, h, dv, bv):
      bv //= 2
    return bv

  def state_stages(self, key: str, b: int, h: int, dk: int, dv: int, c: int, itemsize: int) -> int:
    """Pipelining stages of a state pass (key 'state_fwd' or 'state_bwd'): stages_<key> (the
    backward with few programs: stages_state_bwd_few), fewer where a stage's buffered loads (qg,
    kg, w [C, K]; aqk [C, C]; u or do [C, value block]) and the dots' operands staged through
    shared memory (the state [K, value block], v_new [C, value block]) would pass SHARED_MEMORY,
    as at float32 with K = V = 128. (Compiled for sm_90 at K = V = 128 in bf16, 3 stages take
    208 KB.)"""
    if key == 'state_bwd' and self.few_programs(b, h, dv):
      key = 'state_bwd_few'
    bv = self.state_value_block(b, h, dv)
    per_stage, operands = c * (3 * dk + c + bv) * itemsize, (dk + c) * bv * itemsize
    stages = getattr(self, 'stages_' + key)
    while stages > 1 and stages * per_stage + operands > SHARED_MEMORY:
      stages -= 1
    return stages


def checked(settings, fn: str) -> KdaSettings:
  """settings, or the defaults for None; anything else than a KdaSettings is an error naming `fn`
  (the op whose impl='pallas' was given them)."""
  if settings is None:
    return KdaSettings()
  if not isinstance(settings, KdaSettings):
    raise TypeError(
      f"{fn} impl='pallas': settings must be a KdaSettings (kernels_pallas/kda/settings.py) "
      f'or None, got {type(settings).__name__}'
    )
  return settings
