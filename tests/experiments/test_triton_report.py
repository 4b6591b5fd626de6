"""experiments/tools/triton_report.py on the CPU: each AttnRes kernel's Triton IR is found with the
launch its custom call asks for, and the cleaned IR is valid Triton IR (parsed by jaxlib's own
Triton dialect; compiling it needs the `triton` package, which CI does not have)."""

import collections

import jax.numpy as jnp

from experiments.tools import triton_report
from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings
from kernels_pallas.common import feature_chunk

NAMES = [
  'attnres_phase1_logits',
  'attnres_phase1_combine',
  'attnres_merge_norm',
  'attnres_merge_norm_bwd',
  'attnres_phase1_vdo',
  'attnres_phase1_grads',
]


def test_every_kernel_ir_comes_with_its_launch_and_parses_as_triton_ir():
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect

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
  context = mlir.make_ir_context()
  tt_dialect.register_dialect(context)
  with context:
    for k in kernels:
      assert 'loc' not in k.ir, k.name
      module = ir.Module.parse(k.ir)
      assert f'tt.func public @{k.name}' in str(module)


def test_sass_counts_read_opcodes_without_modifiers_or_predicates():
  sass = (
    '        /*0010*/                   FFMA R1, R2, R3, R4 ;\n'
    '        /*0020*/               @P0 FFMA.FTZ R1, R2, R3, R4 ;\n'
    '        /*0030*/              @!PT LDG.E.128 R4, desc[UR4][R2.64] ;\n'
    '        /*0040*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], RZ ;\n'
    '                                                       /* 0x000fe200078e00ff */\n'
  )
  assert triton_report.sass_counts(sass) == collections.Counter({'FFMA': 2, 'LDG': 1, 'HGMMA': 1})
