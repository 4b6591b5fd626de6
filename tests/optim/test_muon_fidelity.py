"""Muon against published conventions: Moonlight's bf16 Newton-Schulz (PyTorch arithmetic,
emulated in NumPy), float64 iterations, and the DeepSeek-V3 fused MLA matrices."""

import ml_dtypes
import numpy as np
import jax.numpy as jnp
import pytest

from kimijax.optim.muon import NS_COEFFS, newton_schulz

BF16 = ml_dtypes.bfloat16


def _bf16(x):
  """Round to bfloat16 (nearest even), back to float32: what a PyTorch bf16 op stores."""
  return np.asarray(x, np.float32).astype(BF16).astype(np.float32)


def ns_float64(x, steps=5):
  """The Newton-Schulz iteration in float64 (the reference), on x / (||x||_F + 1e-7)."""
  a, b, c = NS_COEFFS
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(steps):
    g = x @ x.T
    x = a * x + (b * g + c * g @ g) @ x
  return x.T if tall else x


def ns_moonlight_bf16(x, steps=5):
  """Moonlight's bf16 iteration with PyTorch's arithmetic: every op's result is rounded to bf16,
  matmuls accumulate in float32, Python-float coefficients stay at full precision. Starts from
  the same rounded normalised input as kimijax (normalised in high precision)."""
  a, b, c = NS_COEFFS
  x = np.asarray(x, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = _bf16(x / (np.linalg.norm(x) + 1e-7))
  for _ in range(steps):
    g = _bf16(x @ x.T)
    poly = _bf16(_bf16(b * g) + _bf16(c * _bf16(g @ g)))
    x = _bf16(_bf16(a * x) + _bf16(poly @ x))
  return x.T if tall else x


def _gradient_like(rng, shape):
  """A random matrix with a decaying spectrum, as gradients have."""
  a, b = shape
  u = rng.standard_normal((a, min(a, b)))
  v = rng.standard_normal((min(a, b), b))
  return (u * (1.0 / (1.0 + np.arange(min(a, b))))) @ v + 0.05 * rng.standard_normal(shape)


@pytest.mark.parametrize('shape', [(64, 192), (192, 64), (96, 96)])
def test_bf16_newton_schulz_is_at_least_as_accurate_as_moonlight(shape):
  """Against a float64 iteration, kimijax's bf16 Newton-Schulz errs no more than PyTorch's bf16
  iteration (Moonlight) does. With the coefficients rounded to bf16 (3.4375, -4.78125, 2.03125)
  and bf16 sums, the error was 1.3-2.5x Moonlight's."""
  rng = np.random.default_rng(0)
  ours, theirs = [], []
  for _ in range(4):
    x = _gradient_like(rng, shape)
    want = ns_float64(x)
    got = np.asarray(newton_schulz(jnp.asarray(x[None], jnp.float32), 5, jnp.bfloat16)[0], np.float64)
    ours.append(np.linalg.norm(got - want) / np.linalg.norm(want))
    theirs.append(np.linalg.norm(ns_moonlight_bf16(x) - want) / np.linalg.norm(want))
  assert np.mean(ours) <= np.mean(theirs), (ours, theirs)


def test_bf16_newton_schulz_coefficients_are_not_rounded():
  """The jaxpr of the bf16 iteration holds the float32 coefficients, not bf16-rounded ones."""
  import jax
  jaxpr = str(jax.make_jaxpr(lambda x: newton_schulz(x, 1, jnp.bfloat16))(jnp.ones((1, 4, 8))))
  assert '3.4375' not in jaxpr and '4.78125' not in jaxpr
