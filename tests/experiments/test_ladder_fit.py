"""experiments/ladder_fit.py on synthetic ladders with a known exponent, offset and compute
multiplier (the published Moonlight-like numbers), and the ladder report's analysis of 5 rungs."""

import numpy as np
import pytest

from experiments import ladder_fit, scaling_ladder

C = np.geomspace(3e-6, 3e-3, 5)  # PFLOP/s-days, a 1000x ladder
A, ALPHA, MULT = 2.608, 0.054, 1.92  # a variant that needs 1/1.92 = 52% of the compute


def test_pure_power_law_recovers_exponent_and_prefactor_and_brackets_them():
  rng = np.random.default_rng(0)
  loss = A * C**-ALPHA * np.exp(rng.normal(0, 2e-3, C.size))
  fit = ladder_fit.fit_power_law(C, loss)
  assert fit['alpha'] == pytest.approx(ALPHA, abs=3e-3)
  assert fit['A'] == pytest.approx(A, rel=0.03)
  lo, hi = fit['alpha_ci95']
  assert lo < ALPHA < hi and hi - lo < 0.02
  exact = ladder_fit.fit_power_law(C, A * C**-ALPHA)
  assert exact['alpha'] == pytest.approx(ALPHA, rel=1e-10) and exact['A'] == pytest.approx(A, rel=1e-10)


def test_the_compute_multiplier_at_matched_loss_is_the_shift_in_compute():
  base = A * C**-ALPHA
  var = A * (MULT * C) ** -ALPHA  # the variant at C does what the baseline does at 1.92 C
  m = ladder_fit.compute_multiplier(ladder_fit.fit_power_law(C, base), ladder_fit.fit_power_law(C, var), base, var)
  assert m['multiplier'] == pytest.approx([MULT] * 3, rel=1e-8)
  assert not m['extrapolated']
  assert m['loss_range'] == pytest.approx([base.min(), var.max()])  # where both ladders have rungs
  # Different exponents: the multiplier changes along the loss range, as C_b(L) / C_v(L) says.
  var2 = 2.5 * C**-0.06
  fb, fv = ladder_fit.fit_power_law(C, base), ladder_fit.fit_power_law(C, var2)
  m2 = ladder_fit.compute_multiplier(fb, fv, base, var2)
  for loss, ratio in zip(m2['losses'], m2['multiplier']):
    assert ratio == pytest.approx((loss / A) ** (-1 / ALPHA) / (loss / 2.5) ** (-1 / 0.06), rel=1e-8)


def test_disjoint_loss_ranges_are_flagged_as_extrapolation():
  base = A * C**-ALPHA
  var = 0.5 * A * C**-ALPHA
  m = ladder_fit.compute_multiplier(ladder_fit.fit_power_law(C, base), ladder_fit.fit_power_law(C, var), base, var)
  assert m['extrapolated']


def test_offset_form_recovers_the_irreducible_loss():
  rng = np.random.default_rng(1)
  e, a, alpha = 1.1, 0.02, 0.3
  loss = e + a * C**-alpha
  fit = ladder_fit.fit_power_law_offset(C, loss * (1 + rng.normal(0, 1e-4, C.size)))
  assert fit['E'] == pytest.approx(e, abs=0.01)
  assert fit['alpha'] == pytest.approx(alpha, rel=0.03)
  assert fit['E_ci95'][0] < e < fit['E_ci95'][1]
  with pytest.raises(ValueError, match='>= 4 rungs'):
    ladder_fit.fit_power_law_offset(C[:3], loss[:3])


def test_ladder_analysis_fits_both_forms_from_five_rungs():
  class Ladder:
    baseline = 'adamw'

  rows = [
    {'variant': v, 'flops': c * ladder_fit.PFLOPS_DAY, 'final_eval_loss': float(A * (k * c) ** -ALPHA)}
    for v, k in (('adamw', 1.0), ('muon', MULT))
    for c in C
  ]
  analysis = scaling_ladder.analyse(Ladder, rows)
  assert set(analysis['fits']['muon']) == {'power_law', 'with_offset'}
  assert analysis['fits']['muon']['power_law']['alpha'] == pytest.approx(ALPHA, rel=1e-8)
  assert analysis['multipliers']['muon']['multiplier'] == pytest.approx([MULT] * 3, rel=1e-6)


def test_offset_form_keeps_the_irreducible_loss_non_negative():
  # Losses that fall faster than a power law towards large C (an unconstrained fit puts E below 0,
  # as the H200 adamw ladder's did): E stays at its bound 0 and the fit is the pure power law.
  loss = 2.0 * C**-0.1 * np.exp(-0.05 * np.log(C / C[0]) ** 2)
  fit = ladder_fit.fit_power_law_offset(C, loss)
  pure = ladder_fit.fit_power_law(C, loss)
  assert fit['E'] == 0.0 and fit['E_at_zero']
  assert fit['alpha'] == pytest.approx(pure['alpha'], rel=1e-6)
  assert not ladder_fit.fit_power_law_offset(C, 1.1 + 0.02 * C**-0.3)['E_at_zero']


def test_rung_time_model_separates_overhead_from_flop_rate():
  # 20 s of overhead per rung; 1 s of fixed cost per rung plus 1e9 FLOP/s: the ETA of two more follows.
  trained = [(1e9, 22.0, 2.0), (4e9, 25.0, 5.0), (1e10, 31.0, 11.0)]
  overhead, per_flop = scaling_ladder.rung_time_model(trained)
  assert overhead == pytest.approx(20.0) and per_flop == pytest.approx(1e-9)
  assert scaling_ladder.predict_seconds((overhead, per_flop), [2e10, 5e10]) == pytest.approx(110.0)
  # The H200 muon ladder's first two rungs (d128, d192): 4.1e13 and 3.8e14 FLOPs in 3.0 and 4.2 s of
  # training at the logged rates; adamw's d384 rung (1.94e16 FLOPs) took 155 s in all.
  model = scaling_ladder.rung_time_model([(4.07e13, 39.0, 3.0), (3.78e14, 46.0, 4.2)])
  assert 100 < scaling_ladder.predict_seconds(model, [1.96e16]) < 200
  # One rung that was mostly compilation (the GPU ladder's first): its overhead is not charged as
  # FLOPs, so a rung of 9x the FLOPs is predicted at 38 + 9 x 2 s, not 9 x 40 s.
  overhead, per_flop = scaling_ladder.rung_time_model([(4e13, 40.0, 2.0)])
  assert scaling_ladder.predict_seconds((overhead, per_flop), [3.6e14]) == pytest.approx(56.0)
  assert scaling_ladder.predict_seconds(None, [1.0]) is None


def test_no_multiplier_from_a_fit_that_does_not_fall():
  rising = ladder_fit.fit_power_law(C, 2.0 * C**0.01)
  falling = ladder_fit.fit_power_law(C, A * C**-ALPHA)
  m = ladder_fit.compute_multiplier(falling, rising, A * C**-ALPHA, 2.0 * C**0.01)
  assert m['multiplier'] == [] and 'alpha <= 0' in m['note']
