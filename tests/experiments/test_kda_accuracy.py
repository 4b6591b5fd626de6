"""experiments/tools/kda_accuracy.py: the relative errors it reports, on the CPU (the Pallas
kernels interpreted) at a tiny shape with a tail."""

import numpy as np

from experiments.tools import kda_accuracy

SHAPE = (1, 40, 2, 16)


def test_float32_errors_are_rounding_only_and_fla_is_skipped_without_torch():
  result, columns = kda_accuracy.errors(SHAPE, 'float32', ['pallas', 'xla_recurrent', 'fla'])
  assert columns == ['o', 'final state', 'dq', 'dk', 'dv', 'df', 'dbeta', 'dinitial_state', 'da_log', 'ddt_bias']
  for impl in ('pallas', 'xla_recurrent'):
    assert len(result[impl]) == len(columns) and max(result[impl]) < 1e-5, (impl, result[impl])
  assert result['fla'].startswith('skipped')


def test_bf16_inputs_show_their_rounding():
  """In bf16 the reference differs: every error is at least the inputs' rounding (2^-9 relative
  per element, so well above 1e-4) and, for the chunk form ('xla'), which rounds nothing but its inputs
  on the CPU, within a few times it."""
  result, columns = kda_accuracy.errors(SHAPE, 'bfloat16', ['xla'], gated=False)
  assert columns[5] == 'dg'
  errors = np.asarray(result['xla'])
  assert errors.min() > 1e-4 and errors.max() < 1e-2, dict(zip(columns, errors))


def test_rel_rmse_against_its_definition():
  ref = np.array([3.0, 4.0])
  assert np.isclose(kda_accuracy.rel_rmse(np.array([3.0, 4.5]), ref), 0.5 / 5.0)
