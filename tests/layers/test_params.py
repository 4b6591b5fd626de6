"""kimijax.layers.params.project against float64 NumPy, and what it writes at one token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.layers.params import project


@pytest.mark.parametrize('t', [1, 5])
@pytest.mark.parametrize('shape', [(8, 6), (8, 3, 4)])
def test_project_is_each_matmul(t, shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, t, shape[0]))
  weights = [rng.standard_normal(shape) for _ in range(3)]
  with jax.default_matmul_precision('highest'):
    got = project(jnp.asarray(x, jnp.float32), *(jnp.asarray(w, jnp.float32) for w in weights))
  assert len(got) == 3
  for y, w in zip(got, weights):
    want = np.tensordot(x, w, axes=([2], [0]))
    assert y.shape == want.shape
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def test_one_token_reads_the_weights_in_place():
  """A decode step (one token per sequence) writes no stacked copy of the weights; many tokens
  share one GEMM over the stacked weights."""
  weights = [jnp.ones((8, 6), jnp.bfloat16)] * 2
  hlo = lambda t: jax.jit(project).lower(jnp.ones((2, t, 8), jnp.bfloat16), *weights).as_text()
  assert 'concatenate' not in hlo(1)
  assert 'concatenate' in hlo(5)
