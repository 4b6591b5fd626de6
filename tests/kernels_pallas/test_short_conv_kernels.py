"""The fused short-conv kernels (kernels_pallas/short_conv): settings the defaults do not reach at
the test sizes, interpreted on the CPU against the XLA form's autodiff, and the Triton lowering
for an H200; tests marked gpu run them compiled at the hybrid benchmark's shape. The op's shared
suite (tests/ops/test_short_conv.py) runs impl='pallas' beside 'xla' against float64 NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rmse, short_conv_grads, short_conv_inputs
from oracles import np_short_conv

from kernels_pallas.short_conv.settings import ShortConvSettings
from kimijax.ops import short_conv as sc


def test_settings_are_frozen_values_parsed_from_the_flags_form():
  s = ShortConvSettings.from_string('dz_tiles=1/dz_rows=32')
  assert (s.dz_tiles, s.dz_rows, s.rows) == (1, 32, ShortConvSettings().rows)
  assert hash(s) == hash(ShortConvSettings(dz_tiles=1, dz_rows=32))
  assert ShortConvSettings().dz_layout(4096) == (16, 32) and ShortConvSettings().dz_layout(96) == (16, 2)
  with pytest.raises(ValueError, match=r"short_conv pallas: unknown keys \['row'\]"):
    ShortConvSettings.from_string('row=16')
  with pytest.raises(TypeError, match='settings must be a ShortConvSettings'):
    sc.short_conv(*short_conv_inputs(0, 1, 8, 1, 16)[:2], 'silu', impl='pallas', settings={'rows': 16})


def test_pallas_under_other_tiles_and_short_sequences():
  """Two heads per program, 16-row tiles, K = 64, and T = 2 < W - 1 (the prefix is padded)."""
  settings = ShortConvSettings(rows=16, heads=2)
  for t in (2, 40):
    x, w, dy = short_conv_inputs(2, 1, t, 4, 64)
    y, prefix = sc.short_conv(x, w, 'silu_l2', impl='pallas', settings=settings)
    np.testing.assert_allclose(y, np_short_conv(x, w, 'silu_l2'), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(prefix, sc.short_conv(x, w, 'silu_l2', impl='xla')[1])
    for got, want in zip(
      short_conv_grads('pallas', 'silu_l2', x, w, dy, settings), short_conv_grads('xla', 'silu_l2', x, w, dy)
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_pallas_dz_over_several_row_tiles_per_program():
  """short_conv_dz with 2 tiles of 16 rows per program: T = 100 pads to 128, so 4 programs along
  T each add two tiles' dw products before their one sum over rows."""
  settings = ShortConvSettings(dz_rows=16, dz_tiles=2)
  assert settings.dz_layout(128) == (16, 2)
  args = short_conv_inputs(6, 1, 100, 2, 16)
  for activation in ('silu', 'silu_l2'):
    for got, want in zip(
      short_conv_grads('pallas', activation, *args, settings), short_conv_grads('xla', activation, *args)
    ):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_kernels_lower_to_triton_for_an_h200():
  """The three kernels of a training step go through the Pallas Triton lowering for an H200 here."""
  from experiments.tools.triton_report import lower_for_h200
  from kernels_pallas.short_conv import short_conv_pallas

  x = jax.ShapeDtypeStruct((2, 100, 4, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 4, 128), jnp.float32)
  loss = lambda x, w: jnp.sum(short_conv_pallas(x, w, 'silu_l2').astype(jnp.float32))
  module = lower_for_h200(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
  for name in ('short_conv_fwd', 'short_conv_dz', 'short_conv_dx'):
    assert name in module, name
  # document masking: each token's reach as a further input
  masked = lambda x, w, reach: jnp.sum(short_conv_pallas(x, w, 'silu_l2', reach=reach).astype(jnp.float32))
  module = lower_for_h200(jax.value_and_grad(masked, argnums=(0, 1)), x, w, jax.ShapeDtypeStruct((2, 100), jnp.int32))
  for name in ('short_conv_fwd', 'short_conv_dz', 'short_conv_dx'):
    assert name in module, name


@pytest.mark.gpu
@pytest.mark.parametrize('activation', ['silu', 'silu_l2'])
def test_gpu_bf16_matches_float32_plain_form(activation):
  """The hybrid benchmark's shape (16, 4096, 8, 128), bf16 inputs, against the plain form on the
  same inputs in float32: relative RMSE <= 5e-3 (output) and 1e-2 (gradients)."""
  x, w, dy = short_conv_inputs(5, 16, 4096, 8, 128, jnp.bfloat16)
  y = sc.short_conv(x, w, activation, impl='pallas')[0]
  assert y.dtype == jnp.bfloat16
  y_ref = sc.short_conv(x.astype(jnp.float32), w, activation, impl='xla')[0]
  assert rel_rmse(y, y_ref) <= 5e-3
  got = short_conv_grads('pallas', activation, x, w, dy)
  want = short_conv_grads('xla', activation, x.astype(jnp.float32), w, dy)
  for name, a, b in zip(('dx', 'dw'), got, want):
    assert rel_rmse(a, b) <= 1e-2, name
