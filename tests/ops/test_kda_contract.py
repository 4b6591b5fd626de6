"""kda(..., check_inputs=True): arrays outside KDA's contract (q, k not L2-normalised, g > 0, beta
outside [0, 1], NaN) stop with a ValueError naming the broken condition, where without the check
the output is silently NaN or Inf; inside jax.jit the same conditions come out of
jax.experimental.checkify. Inputs inside the contract pass and give the unchecked output."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from kimijax.ops.kda import kda

B, T, H, K = 1, 128, 2, 8


def _inputs():
  q, k, v, f = jax.random.normal(jax.random.key(0), (4, B, T, H, K))
  unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
  return {'q': unit(q), 'k': unit(k), 'v': v, 'g': -jax.nn.softplus(f), 'beta': jax.nn.sigmoid(f[..., 0])}


BROKEN = {
  'k not normalised': (lambda x: {**x, 'k': 4.0 * x['k']}, r'kda: k is not L2-normalised over its last axis'),
  'q not normalised': (lambda x: {**x, 'q': 3.0 * x['q']}, r'kda: q is not L2-normalised over its last axis'),
  'g positive': (lambda x: {**x, 'g': -x['g']}, r'kda: g has positive entries \(max [\d.]+\); g is the log-decay'),
  'beta above 1': (lambda x: {**x, 'beta': 2.0 + x['beta']}, r'kda: beta lies outside \[0, 1\] \(from [\d.]+ to'),
  'nan in v': (
    lambda x: {**x, 'q': x['q'].at[0, 3, 1, 2].set(jnp.nan)},
    r'kda: q has NaN or Inf entries \(1 of them\)',
  ),
}


def _call(x, **kw):
  return kda(x['q'], x['k'], x['v'], x['g'], x['beta'], **kw)[0]


def test_inputs_inside_the_contract_pass_unchanged():
  x = _inputs()
  np.testing.assert_array_equal(np.asarray(_call(x, check_inputs=True)), np.asarray(_call(x)))
  zero = {**x, 'k': x['k'].at[0, 5].set(0.0)}  # a zero key (e.g. padding) writes nothing: allowed
  _call(zero, check_inputs=True)


@pytest.mark.parametrize('case', list(BROKEN))
def test_each_broken_condition_is_named(case):
  breaks, message = BROKEN[case]
  with pytest.raises(ValueError, match=message):
    _call(breaks(_inputs()), check_inputs=True)


def test_unchecked_inputs_outside_the_contract_give_nan_or_inf():
  """What the check is for: the op itself does not notice."""
  x = _inputs()
  for name, broken in (('k', {**x, 'k': 30.0 * x['k']}), ('g', {**x, 'g': 2.0 - x['g']})):
    assert not bool(jnp.all(jnp.isfinite(_call(broken)))), name
    with pytest.raises(ValueError, match=f'kda: {name} '):
      _call(broken, check_inputs=True)


def test_under_jit_checkify_names_the_condition():
  checked = checkify.checkify(jax.jit(lambda x: _call(x, check_inputs=True)))
  error, _ = checked(BROKEN['g positive'][0](_inputs()))
  with pytest.raises(Exception, match='kda: g has positive entries'):
    error.throw()
  error, out = checked(_inputs())
  error.throw()  # nothing to report
  assert bool(jnp.all(jnp.isfinite(out)))
