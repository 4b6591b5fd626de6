"""experiments/tools/moe_accuracy.py on the CPU: its float64 reference (a hand-written backward)
against the grouped matmuls in float32, the bf16 errors it reports, and its refusals."""

import numpy as np
import pytest

from experiments.tools import moe_accuracy

SHAPE = (96, 32, 16, 8, 2)  # T, D, F, E, K: experts 3 and 7 receive no token


def test_float32_matches_the_float64_reference():
  """The reference's hand-written backward and the op's autodiff agree to float32 rounding."""
  for row in moe_accuracy.measure(SHAPE, ['xla', 'xla_blocked', 'tokamax'], 'float32', seed=0):
    if row['impl'] == 'tokamax':
      assert 'needs an NVIDIA GPU' in row['skipped']
      continue
    errors = {n: row[n] for n in ('y', 'x', 'w_gate', 'w_up', 'w_down')}
    assert max(errors.values()) < 1e-5, (row['impl'], errors)


def test_bf16_errors_are_the_rounding_of_bf16():
  (row,) = moe_accuracy.measure(SHAPE, ['xla_blocked'], 'bfloat16', seed=1)
  errors = np.asarray([row[n] for n in ('y', 'x', 'w_gate', 'w_up', 'w_down')])
  assert errors.min() > 1e-4 and errors.max() < 1e-2, errors


def test_bad_shape_is_named():
  with pytest.raises(ValueError, match=r"'8x4x2' is not 'TxDxFxExK'"):
    moe_accuracy.parse_shape('8x4x2')
