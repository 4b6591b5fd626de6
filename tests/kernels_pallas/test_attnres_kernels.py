"""The Block AttnRes Pallas kernels (kernels_pallas/attnres/) themselves: their tile settings are
checked, and every kernel lowers through Triton for an H200 on the CPU. Their numbers are tested
through the op, tests/ops/test_attnres.py."""

import jax.numpy as jnp
import pytest
from helpers import random_block, random_merge


def test_kernel_settings_are_checked():
  """A mistyped settings key is an error naming it, not silently the default; so is a dot's row
  tile under 16; a feature chunk is a power of two whatever the target."""
  from kernels_pallas.attnres.settings import MergeNormSettings, Phase1Settings
  from kernels_pallas.common import feature_chunk
  from kernels_pallas.settings import parse_settings

  with pytest.raises(ValueError, match="unknown keys \\['bt_grad'\\]"):
    Phase1Settings().replace(bt_grad=32)
  with pytest.raises(ValueError, match='rows_grads and bt_logits .* >= 16; got 8 and 64'):
    Phase1Settings(rows_grads=8)
  with pytest.raises(ValueError, match='bt_grads \\(48\\) must divide rows_grads \\(128\\)'):
    Phase1Settings.from_string('bt_grads=48')
  assert feature_chunk(96, 48) == 32 and feature_chunk(1024, 1024) == 1024
  with pytest.raises(ValueError, match="unknown keys \\['wraps'\\]"):
    MergeNormSettings.from_string('wraps=4')
  assert parse_settings('bt=32/warps=8') == {'bt': 32, 'warps': 8}
  with pytest.raises(ValueError, match='key=int'):
    parse_settings('bt')
  # The kernels take their family's settings object, nothing else (a dict is not read as one).
  from kernels_pallas.attnres.merge_norm import merge_norm as merge_kernel
  from kernels_pallas.attnres.phase1 import phase1 as kernel

  sources, _, queries = random_block(n=2, s=2, b=1, t=8, d=32)
  with pytest.raises(TypeError, match='settings must be a Phase1Settings'):
    kernel([jnp.asarray(v) for v in sources], jnp.asarray(queries), settings={'bt': 32}, interpret=True)
  with pytest.raises(TypeError, match='settings must be a MergeNormSettings'):
    merge_kernel(
      *random_merge((1, 8, 32)), eps=1e-6, norm_eps=1e-6, dtype=jnp.float32, settings=Phase1Settings(), interpret=True
    )


@pytest.mark.parametrize('dtype,n,s', [(jnp.bfloat16, 9, 6), (jnp.float32, 1, 16), (jnp.bfloat16, 3, 1)])
def test_pallas_kernels_lower_to_triton_for_an_h200(dtype, n, s):
  """Forward and backward of phase 1 and of merge_norm (with the addend and a later use of the
  partial sum) at the bench model's width, in the dtypes and query counts training uses, lowered
  for an H200 on this machine: the Triton lowering rejects what it cannot express (a shape that is
  not a power of two, an op without a Triton rule) before any GPU time is spent."""
  from experiments.tools.triton_report import attnres_block, lower_for_h200

  fn, args = attnres_block(n, s, 4096, 1024, dtype)
  module = lower_for_h200(fn, *args)
  for name in ('phase1_logits', 'phase1_combine', 'phase1_vdo', 'phase1_grads', 'merge_norm', 'merge_norm_bwd'):
    assert f'"attnres_{name}"' in module, name
