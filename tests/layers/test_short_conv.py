"""The ShortConv layer (kimijax/layers/short_conv.py) under every implementation of its op: taps
initialised as uniform(-1/sqrt(width), 1/sqrt(width)) [width, H, K] float32, its output against the
float64 conv and activation (tests/oracles.py), and decoding from its returned prefix."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import impl_params
from oracles import np_short_conv

from kimijax.layers.short_conv import ShortConv
from kimijax.ops import short_conv as sc

B, T, H, K = 2, 13, 2, 16


@pytest.mark.parametrize('activation', sc.ACTIVATIONS)
@pytest.mark.parametrize('impl', impl_params(sc.IMPLS))
def test_layer_matches_numpy_and_decodes_from_its_prefix(impl, activation):
  layer = ShortConv(width=4, dtype=jnp.float32, activation=activation, impl=impl)
  x = jax.random.normal(jax.random.key(1), (B, T, H, K))
  params = nn.unbox(layer.init(jax.random.key(0), x)['params'])
  w = params['kernel']
  assert w.shape == (4, H, K) and w.dtype == jnp.float32 and float(jnp.max(jnp.abs(w))) <= 0.5
  y, prefix = layer.apply({'params': params}, x)
  np.testing.assert_allclose(y, np_short_conv(x, w, activation), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(prefix, x[:, -3:])
  _, head = layer.apply({'params': params}, x[:, :5])
  rest, _ = layer.apply({'params': params}, x[:, 5:], head)
  np.testing.assert_allclose(rest, y[:, 5:], rtol=1e-6, atol=1e-6)


def test_input_is_cast_to_the_compute_dtype():
  layer = ShortConv(dtype=jnp.bfloat16, activation='silu')
  x = jax.random.normal(jax.random.key(1), (B, T, H, K))
  params = layer.init(jax.random.key(0), x)
  y, prefix = layer.apply(params, x)
  assert y.dtype == jnp.bfloat16 and prefix.dtype == jnp.bfloat16
