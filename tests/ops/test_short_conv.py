"""KDA's short convolution + activation (kimijax/ops/short_conv.py): every implementation in IMPLS
('xla', 'pallas'; the fused kernels interpreted on the CPU) against a float64 NumPy transcription of
docs/kda.md's conv and activations, forward and gradients (central finite differences of it), and
against the XLA form's autodiff at a longer, tiled shape. The kernels' own settings and lowering:
tests/kernels_pallas/test_short_conv_kernels.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import impl_params, short_conv_grads, short_conv_inputs
from oracles import np_short_conv

from kimijax.ops import short_conv as sc

IMPLS = impl_params(sc.IMPLS)
REFERENCE = 'xla'


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
@pytest.mark.parametrize('impl', IMPLS)
def test_forward_matches_numpy(impl, activation):
  """T = 45: one tile and a tail of 13 rows (the kernels' tile is 32 rows)."""
  x, w, _ = short_conv_inputs(0, 2, 45, 3, 16)
  y, prefix = sc.short_conv(x, w, activation, impl=impl)
  np.testing.assert_allclose(y, np_short_conv(x, w, activation), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(prefix, x[:, -3:])


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
@pytest.mark.parametrize('impl', IMPLS)
def test_gradients_match_float64_finite_differences(impl, activation):
  """The gradients in x and the taps against central differences of the float64 transcription,
  at T = 6 (fewer rows than a tile)."""
  x, w, dy = short_conv_inputs(7, 1, 6, 1, 16)
  args = [np.asarray(a, np.float64) for a in (x, w)]
  ref_loss = lambda a: np.sum(np_short_conv(a[0], a[1], activation) * np.asarray(dy, np.float64))
  for i, got in enumerate(short_conv_grads(impl, activation, x, w, dy)):
    fd = np.zeros_like(args[i])
    for idx in np.ndindex(args[i].shape):
      plus, minus = [a.copy() for a in args], [a.copy() for a in args]
      plus[i][idx] += 1e-6
      minus[i][idx] -= 1e-6
      fd[idx] = (ref_loss(plus) - ref_loss(minus)) / 2e-6
    np.testing.assert_allclose(got, fd, rtol=1e-4, atol=1e-5 * np.abs(fd).max(), err_msg=('dx', 'dw')[i])


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
@pytest.mark.parametrize('impl', [p for p in IMPLS if p.values[0] != REFERENCE])
def test_gradients_match_autodiff_of_the_plain_form(impl, activation):
  args = short_conv_inputs(1, 2, 45, 3, 16)
  for got, want in zip(short_conv_grads(impl, activation, *args), short_conv_grads(REFERENCE, activation, *args)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))


@pytest.mark.parametrize('impl', IMPLS)
def test_a_prefix_continues_the_sequence(impl):
  """Decoding: the conv over x[6:] from x[:6]'s prefix equals the conv over all of x."""
  x, w, _ = short_conv_inputs(3, 2, 20, 2, 16)
  full, _ = sc.short_conv(x, w, 'silu', impl=impl)
  _, prefix = sc.short_conv(x[:, :6], w, 'silu', impl=impl)
  rest, _ = sc.short_conv(x[:, 6:], w, 'silu', prefix, impl=impl)
  np.testing.assert_allclose(rest, full[:, 6:], rtol=1e-6, atol=1e-6)


def test_bad_arguments_name_what_is_wrong():
  x, w, _ = short_conv_inputs(4, 1, 8, 2, 24)
  with pytest.raises(ValueError, match=r'K = 24 must be a power of two >= 16'):
    sc.short_conv(x, w, 'silu', impl='pallas')
  with pytest.raises(ValueError, match=r"activation='gelu' is unknown"):
    sc.short_conv(x, w, 'gelu')
  with pytest.raises(ValueError, match=r"impl='cuda' is unknown"):
    sc.short_conv(x, w, impl='cuda')
  with pytest.raises(ValueError, match=r'w \[W, H, K\]; got x \[1, 8, 2, 24\], w \[4, 3, 24\]'):
    sc.short_conv(x, jnp.zeros((4, 3, 24)))
