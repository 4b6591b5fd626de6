"""KDA's short convolution + activation (kimijax/ops/short_conv.py): both implementations against a
float64 NumPy transcription of SPEC §1's conv and activations, and the fused Pallas kernels'
gradients against XLA autodiff of the plain form. On the CPU the kernels run in Pallas interpret
mode; tests marked gpu run them compiled at the hybrid benchmark's shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.ops import short_conv as sc

from helpers import rel_rmse
from oracles import np_conv, np_silu


def _np_short_conv(x, w, activation):
  y = np_conv(np.asarray(x, np.float64), np.asarray(w, np.float64))
  if activation == 'none':
    return y
  a = np_silu(y)
  return a / np.sqrt(np.sum(a * a, -1, keepdims=True) + 1e-6) if activation == 'silu_l2' else a


def _inputs(seed, b, t, h, dk, dtype=jnp.float32):
  kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (b, t, h, dk), jnp.float32).astype(dtype)
  w = jax.random.uniform(kw, (4, h, dk), jnp.float32, -0.5, 0.5)
  dy = jax.random.normal(kd, (b, t, h, dk), jnp.float32)
  return x, w, dy


def _grads(impl, activation, x, w, dy):
  loss = lambda x, w: jnp.sum(sc.short_conv(x, w, activation, impl=impl)[0].astype(jnp.float32) * dy)
  return jax.jit(jax.grad(loss, (0, 1)))(x, w)


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
@pytest.mark.parametrize('impl', tuple(sc.IMPLS))
def test_forward_matches_numpy(impl, activation):
  """T = 45: one tile and a tail of 13 rows (the kernels' tile is 32 rows)."""
  x, w, _ = _inputs(0, 2, 45, 3, 16)
  y, prefix = sc.short_conv(x, w, activation, impl=impl)
  np.testing.assert_allclose(y, _np_short_conv(x, w, activation), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(prefix, x[:, -3:])


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
def test_pallas_gradients_match_autodiff_of_the_plain_form(activation):
  args = _inputs(1, 2, 45, 3, 16)
  for got, want in zip(_grads('pallas', activation, *args), _grads('xla', activation, *args)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_pallas_under_other_tiles_and_short_sequences(monkeypatch):
  """Two heads per program, 16-row tiles, K = 64, and T = 2 < W - 1 (the prefix is padded)."""
  from kernels_pallas.short_conv import conv
  monkeypatch.setattr(conv, 'TILES', dict(conv.TILES, rows=16, heads=2))
  for t in (2, 40):
    x, w, dy = _inputs(2, 1, t, 4, 64)
    y, prefix = sc.short_conv(x, w, 'silu_l2', impl='pallas')
    np.testing.assert_allclose(y, _np_short_conv(x, w, 'silu_l2'), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(prefix, sc.short_conv(x, w, 'silu_l2', impl='xla')[1])
    for got, want in zip(_grads('pallas', 'silu_l2', x, w, dy), _grads('xla', 'silu_l2', x, w, dy)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_pallas_dz_over_several_row_tiles_per_program(monkeypatch):
  """short_conv_dz with 2 tiles of 16 rows per program: T = 100 pads to 128, so 4 programs along
  T each add two tiles' dw products before their one sum over rows."""
  from kernels_pallas.short_conv import conv
  monkeypatch.setattr(conv, 'TILES', dict(conv.TILES, dz_rows=16, dz_tiles=2))
  args = _inputs(6, 1, 100, 2, 16)
  for activation in ('silu', 'silu_l2'):
    for got, want in zip(_grads('pallas', activation, *args), _grads('xla', activation, *args)):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


def test_pallas_with_a_prefix_continues_the_sequence():
  """Decoding: the conv over x[6:] from x[:6]'s prefix equals the conv over all of x."""
  x, w, _ = _inputs(3, 2, 20, 2, 16)
  full, _ = sc.short_conv(x, w, 'silu', impl='pallas')
  _, prefix = sc.short_conv(x[:, :6], w, 'silu', impl='pallas')
  rest, _ = sc.short_conv(x[:, 6:], w, 'silu', prefix, impl='pallas')
  np.testing.assert_allclose(rest, full[:, 6:], rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_what_is_wrong():
  x, w, _ = _inputs(4, 1, 8, 2, 24)
  with pytest.raises(ValueError, match=r"K = 24 must be a power of two >= 16"):
    sc.short_conv(x, w, 'silu', impl='pallas')
  with pytest.raises(ValueError, match=r"activation='gelu' is unknown"):
    sc.short_conv(x, w, 'gelu')
  with pytest.raises(ValueError, match=r"impl='cuda' is unknown"):
    sc.short_conv(x, w, impl='cuda')
  with pytest.raises(ValueError, match=r"w \[W, H, K\]; got x \[1, 8, 2, 24\], w \[4, 3, 24\]"):
    sc.short_conv(x, jnp.zeros((4, 3, 24)))


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


@pytest.mark.gpu
@pytest.mark.parametrize('activation', ['silu', 'silu_l2'])
def test_gpu_bf16_matches_float32_plain_form(activation):
  """The hybrid benchmark's shape (16, 4096, 8, 128), bf16 inputs, against the plain form on the
  same inputs in float32: relative RMSE <= 5e-3 (output) and 1e-2 (gradients)."""
  x, w, dy = _inputs(5, 16, 4096, 8, 128, jnp.bfloat16)
  y = sc.short_conv(x, w, activation, impl='pallas')[0]
  assert y.dtype == jnp.bfloat16
  y_ref = sc.short_conv(x.astype(jnp.float32), w, activation, impl='xla')[0]
  assert rel_rmse(y, y_ref) <= 5e-3
  got = _grads('pallas', activation, x, w, dy)
  want = _grads('xla', activation, x.astype(jnp.float32), w, dy)
  for name, a, b in zip(('dx', 'dw'), got, want):
    assert rel_rmse(a, b) <= 1e-2, name
