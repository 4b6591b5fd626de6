"""experiments/tools/triton_report.py on the CPU: each op's kernels are found with the launch their
custom calls ask for (grid, warps, stages, computed here from the family's settings and the shapes),
and each IR is valid Triton IR (parsed by jaxlib's own Triton dialect; compiling it needs the
`triton` package, which CI does not have)."""

import collections
import math
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest
from helpers import cpu_subprocess_env

from experiments.tools import triton_report
from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings
from kernels_pallas.common import feature_chunk
from kernels_pallas.kda.settings import KdaSettings
from kernels_pallas.mla_decode.settings import MlaDecodeSettings
from kernels_pallas.moe.settings import MoeSettings
from kernels_pallas.short_conv.settings import ShortConvSettings

NAMES = [
  'attnres_phase1_logits',
  'attnres_phase1_combine',
  'attnres_merge_norm',
  'attnres_merge_norm_bwd',
  'attnres_phase1_vdo',
  'attnres_phase1_grads',
]


def launch_grid(*grid):
  """The CUDA grid of a Pallas grid as the Triton lowering launches it: the dims before the last
  two folded into the first, then padded to three (at these sizes no dim passes CUDA's limits)."""
  if len(grid) > 3:
    grid = (math.prod(grid[:-2]), *grid[-2:])
  return tuple(grid) + (1,) * (3 - len(grid))


def pow2_tile(n, at_most):
  """The largest power of two <= at_most (a power of two) that divides n."""
  return math.gcd(n, at_most)


def assert_parses_as_triton_ir(kernels):
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

  context = mlir.make_ir_context()
  tt_dialect.register_dialect(context)
  with context:
    for k in kernels:
      assert 'loc' not in k.ir, k.name
      module = ir.Module.parse(k.ir)
      assert f'tt.func public @{k.name.split("#")[0]}' in str(module)


def _call(builder, *args):
  """(fn, *args) of a builder's (fn, args): kernel_irs's arguments."""
  fn, fn_args = builder(*args)
  return (fn, *fn_args)


def launches(kernels):
  """{(name without its variant number, (warps, stages, grid)): how many variants}."""
  return collections.Counter((k.name.split('#')[0], (k.warps, k.stages, k.grid)) for k in kernels)


def test_every_kernel_ir_comes_with_its_launch_and_parses_as_triton_ir():
  n, s, m, d = 3, 2, 512, 256
  fn, args = triton_report.attnres_block(n, s, m, d, jnp.bfloat16)
  kernels = triton_report.kernel_irs(fn, *args)
  assert sorted(k.name for k in kernels) == sorted(NAMES)
  by_name = {k.name: k for k in kernels}
  t = Phase1Settings()
  grads = by_name['attnres_phase1_grads']
  assert (grads.warps, grads.stages) == (t.warps_grads, t.stages_grads)
  assert grads.grid == (d // feature_chunk(d, t.dc_grads), m // t.rows_grads, 1)
  assert by_name['attnres_phase1_logits'].grid == (m // t.bt_logits, 1, 1)
  assert by_name['attnres_merge_norm'].warps == MergeNormSettings().warps
  assert_parses_as_triton_ir(kernels)


def test_kda_kernels_forward_and_backward_with_the_fused_gate():
  """The gated op of the KDA layer: both branches of the flat/steep conditional (the scores kernels
  with and without the pairwise kernels' inputs), the state pass of the forward and of the
  backward's recomputation."""
  b, t, h, d = 2, 256, 4, 128
  c, sub = 64, 16  # the chunk at T >= 64 and its sub-chunks
  nc, nb = t // c, c // sub
  s = KdaSettings()
  bv = s.state_value_block(b, h, d)
  state = lambda key: s.state_stages(key, b, h, d, d, c, 2)
  expected = {
    'kda_gated_cumsum': (s.warps_cumsum, s.stages, launch_grid(b, h, nc, d // s.features_cumsum)),
    'kda_scores_fwd': (s.warps_scores, s.stages, launch_grid(b, h, nc, nb)),
    'kda_diag_fwd': (s.warps_diag, s.stages, launch_grid(b, t, h // min(h, s.heads_diag))),
    'kda_wy_inverse': (s.warps_wy, s.stages, launch_grid(b, h, nc)),
    'kda_wy_apply': (s.warps_apply, s.stages, launch_grid(b, h, nc)),
    'kda_state_fwd': (s.warps_state, state('state_fwd'), launch_grid(b, h, d // bv)),
    'kda_state_bwd': (s.warps_state, state('state_bwd'), launch_grid(b, h, d // bv)),
    'kda_chunk_cotangents': (s.warps_cotangents, s.stages, launch_grid(b, h, nc)),
    'kda_wy_bwd': (s.warps_wy_bwd, s.stages, launch_grid(b, h, nc)),
    'kda_scores_bwd': (s.warps_scores_bwd, s.stages, launch_grid(b, h, nc, nb, d // s.features_bwd)),
    'kda_diag_bwd': (s.warps_diag_bwd, s.stages, launch_grid(b, t, h // min(h, s.heads_diag_bwd))),
    'kda_gated_reverse_cumsum': (
      s.warps_reverse_cumsum,
      s.stages,
      launch_grid(b, h, nc, d // s.features_reverse_cumsum),
    ),
  }
  twice = {'kda_scores_fwd', 'kda_scores_bwd', 'kda_state_fwd'}
  kernels = triton_report.kernel_irs(*_call(triton_report.kda_op, b, t, h, d, jnp.bfloat16))
  assert launches(kernels) == {(name, launch): 1 + (name in twice) for name, launch in expected.items()}
  assert_parses_as_triton_ir(kernels)


def test_short_conv_kernels_at_padded_length_and_other_settings():
  b, t, h, d = 2, 200, 4, 64
  s = ShortConvSettings.from_string('rows=16/heads=2/warps=4')
  tp = -(-t // s.rows) * s.rows  # T padded to whole row tiles
  hb = min(h, s.heads)
  rows, tiles = s.dz_layout(tp)
  conv = (s.warps, s.stages, launch_grid(b, tp // s.rows, h // hb))
  kernels = triton_report.kernel_irs(*_call(triton_report.short_conv_op, b, t, h, d, jnp.bfloat16, s))
  assert launches(kernels) == {
    ('short_conv_fwd', conv): 1,
    ('short_conv_dz', (s.warps, s.stages, launch_grid(b, tp // (rows * tiles), h // hb))): 1,
    ('short_conv_dx', conv): 1,
  }
  assert_parses_as_triton_ir(kernels)


@pytest.mark.parametrize('dr,text', [(64, ''), (0, 'block_s=128/warps=8/stages=3')])
def test_mla_decode_kernel_splits_the_context(dr, text):
  b, h, context, r = 2, 8, 1000, 128
  s = MlaDecodeSettings.from_string(text)
  splits = min(s.programs // b, -(-context // s.block_s))  # one head block: H = 8 is padded to 16
  kernels = triton_report.kernel_irs(*_call(triton_report.mla_decode_op, b, h, context, r, dr, jnp.bfloat16, s))
  assert launches(kernels) == {('mla_decode', (s.warps, s.stages, (b, 1, splits))): 1}
  assert_parses_as_triton_ir(kernels)


@pytest.mark.parametrize('text', ['', 'block_m=64/block_n=64/block_k=32/warps=8/stages=2'])
def test_moe_kernels_forward_and_backward(text):
  """The routed experts' kernels: gate|up with SwiGLU, the tile matmul forward (W_down) and
  transposed (u from W_down, dx from W_in), the weight gradients of W_down and W_in; F = 192
  takes output tiles of 64 where block_n 128 does not divide it."""
  t, d, e, k, f = 512, 256, 8, 2, 192
  s = MoeSettings.from_string(text)
  tiles = -(-t * k // s.block_m) + e  # each expert padded to whole tiles
  cols = lambda n: n // pow2_tile(n, s.block_n)
  launch = lambda *grid: (s.warps, s.stages, launch_grid(*grid))
  kernels = triton_report.kernel_irs(*_call(triton_report.moe_op, t, d, e, k, f, jnp.bfloat16, s))
  assert launches(kernels) == {
    ('moe_gate_up_swiglu', launch(tiles, cols(f))): 1,
    ('moe_tile_matmul', launch(tiles, cols(d))): 2,  # h @ W_down, and dx from W_in transposed
    ('moe_tile_matmul', launch(tiles, cols(f))): 1,  # u from W_down transposed
    ('moe_expert_weight_grad', launch(e, cols(f), cols(d))): 1,  # dW_down
    ('moe_expert_weight_grad', launch(e, cols(d), cols(2 * f))): 1,  # dW_in
  }
  assert_parses_as_triton_ir(kernels)


def test_a_bad_settings_key_is_one_error_naming_the_flag():
  with pytest.raises(SystemExit, match=r"--settings='block=32': moe pallas: unknown keys \['block'\]"):
    triton_report.parse_settings('block=32', 'settings', MoeSettings)


def test_sizes_the_kernels_do_not_take_are_one_line_naming_the_op():
  """A width the MoE kernels cannot tile: one line from the command, no traceback (lowering fails
  before any compilation, so a stand-in for the Triton Python is enough)."""
  sizes = ['--tokens=64', '--d_model=1000', '--experts=4', '--top_k=2', '--expert_hidden=64']
  proc = subprocess.run(
    [
      sys.executable,
      '-m',
      'experiments.tools.triton_report',
      '--op=moe',
      *sizes,
      f'--triton_python={shutil.which("true")}',
    ],
    cwd=pathlib.Path(__file__).resolve().parents[2],
    env=cpu_subprocess_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 1 and 'Traceback' not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip() == (
    'triton_report.py: --op=moe at moe, T = 64, D = 1000, E = 4, top-2, F = 64, bfloat16: '
    "moe impl='pallas' needs d_model (1000) to be a multiple of 16"
  )


def test_sass_counts_read_opcodes_without_modifiers_or_predicates():
  sass = (
    '        /*0010*/                   FFMA R1, R2, R3, R4 ;\n'
    '        /*0020*/               @P0 FFMA.FTZ R1, R2, R3, R4 ;\n'
    '        /*0030*/              @!PT LDG.E.128 R4, desc[UR4][R2.64] ;\n'
    '        /*0040*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ ;\n'
    '                                                       /* 0x000fe200078e00ff */\n'
  )
  assert triton_report.sass_counts(sass) == collections.Counter({'FFMA': 2, 'LDG': 1, 'HGMMA': 1})
