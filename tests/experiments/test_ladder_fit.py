"""experiments/ladder_fit.py on synthetic ladders with a known exponent, offset and compute
multiplier (the published Moonlight-like numbers), the ladder report's analysis of 5 rungs
(experiments/ladder_report.py) and the ladder's time model (experiments/scaling_ladder.py)."""

import numpy as np
import pytest

from experiments import ladder_fit, ladder_report, scaling_ladder

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


def synthetic_rows(opt_share: float = 0.25) -> list[dict]:
  """Five rungs per variant on a known power law in model FLOPs: adamw (no optimizer FLOPs) and
  muon, which reaches each loss with 1 / MULT of adamw's model FLOPs and adds optimizer FLOPs of
  opt_share x its model FLOPs."""
  rows = []
  for v, k, share in (('adamw', 1.0, 0.0), ('muon', MULT, opt_share)):
    for c in C:
      model = c * ladder_fit.PFLOPS_DAY
      rows.append(
        {
          'variant': v,
          'model_flops': model,
          'optimizer_flops': share * model,
          'flops': (1 + share) * model,
          'final_eval_loss': float(A * (k * c) ** -ALPHA),
        }
      )
  return rows


class Ladder:
  baseline = 'adamw'


def test_ladder_analysis_fits_both_forms_from_five_rungs_on_both_counts_of_compute():
  # On model FLOPs muon's multiplier is MULT; C = model + optimizer FLOPs is (1 + share) x muon's
  # model FLOPs and adamw's alone, so there it is MULT / (1 + share), in closed form.
  analysis = ladder_report.analyse(Ladder, synthetic_rows(0.25))
  for compute in ('model', 'total'):
    assert set(analysis['fits'][compute]['muon']) == {'power_law', 'with_offset'}
    assert analysis['fits'][compute]['muon']['power_law']['alpha'] == pytest.approx(ALPHA, rel=1e-8)
  assert analysis['multipliers']['model']['muon']['multiplier'] == pytest.approx([MULT] * 3, rel=1e-6)
  assert analysis['multipliers']['total']['muon']['multiplier'] == pytest.approx([MULT / 1.25] * 3, rel=1e-6)
  # The verdict reads model FLOPs, at the largest rungs' loss (the lower end of the range).
  reading = analysis['verdict']['muon']
  assert analysis['verdict_compute'] == 'model' and reading['multiplier'] == pytest.approx(MULT, rel=1e-6)
  assert reading['loss'] == min(analysis['multipliers']['model']['muon']['losses'])


def test_the_report_gives_both_multipliers_and_the_verdicts_basis():
  rows = synthetic_rows(0.25)
  analysis = ladder_report.analyse(Ladder, rows)
  assert ladder_report.shown_computes(rows) == ['model', 'total']
  # no optimizer FLOPs anywhere: the two counts are equal and the report shows one
  assert ladder_report.shown_computes(synthetic_rows(0.0)) == ['model']
  lines = ladder_report._verdict_lines(Ladder, analysis)
  assert lines[0].startswith('Verdict basis: the multiplier on C = model FLOPs')
  assert lines[2].startswith(f'- `muon` at L* = {analysis["verdict"]["muon"]["loss"]:.3f}: **1.92x**')


def test_a_variant_without_the_split_keeps_its_model_plus_optimizer_multiplier_in_the_report():
  """A ladder.json where the split was counted again for the baseline and one variant but not for
  another ('muon_old': only C = model + optimizer FLOPs): the table still gives muon_old's
  multiplier on model + optimizer FLOPs, MULT / 1.25 in closed form (optimizer FLOPs 0.25 x its
  model FLOPs, none for adamw), and the verdict says it has no reading for muon_old."""
  rows = synthetic_rows(0.25)
  unsplit = {'variant': 'muon_old', 'model_flops': None, 'optimizer_flops': None}
  old = [{**r, **unsplit} for r in rows if r['variant'] == 'muon']
  rows = [
    {
      **r,
      'rung': f'r{i % 5}',
      **dict.fromkeys(('d_model', 'num_layers', 'num_heads', 'params', 'batch_size', 'steps', 'tokens'), 1),
      'learning_rate': 1e-3,
      'final_train_loss': r['final_eval_loss'],
      **dict.fromkeys(('epochs', 'tokens_per_sec', 'wall_seconds')),
    }
    for i, r in enumerate(rows + old)
  ]
  ladder = Ladder()
  ladder.name, ladder.rule, ladder.tokens_per_param = 'synthetic', 'a rule', 20
  ladder.variants = {'adamw': (), 'muon': (), 'muon_old': ()}
  analysis = ladder_report.analyse(ladder, rows)
  assert set(analysis['multipliers']['model']) == {'muon'} and set(analysis['verdict']) == {'muon'}
  assert analysis['multipliers']['total']['muon_old']['multiplier'] == pytest.approx([MULT / 1.25] * 3, rel=1e-6)
  prov = {'date': 'today', 'hardware': 'here', 'command': 'python -m experiments.scaling_ladder'}
  md = ladder_report.markdown(ladder, rows, analysis, prov, 'ladder.png', len(rows))
  table = md.split('## Compute multiplier')[1].split('Verdict basis')[0]
  assert [line.split(' | ')[:2] for line in table.splitlines() if line.startswith('| muon')] == [
    ['| muon', 'model'],
    ['| muon', 'model + optimizer'],
    ['| muon_old', 'model + optimizer'],
  ]
  assert f'**{MULT / 1.25:.3g}x**' in table.splitlines()[-2]
  verdicts = [line for line in md.splitlines() if line.startswith('- `')]
  assert verdicts[0].startswith('- `muon` at L* = ') and verdicts[1].startswith('- `muon_old`: no reading')
  assert len(verdicts) == 2


@pytest.mark.parametrize(
  'ci,reading',
  [
    ([1.1, 2.0], 'less compute'),
    ([0.5, 0.9], 'more compute'),
    ([0.6, 1.6], 'inside the noise'),
    ([None] * 2, 'undefined'),
  ],
)
def test_the_verdict_reads_the_interval_against_one(ci, reading):
  m = {'losses': [1.8, 2.0], 'multiplier': [1.0, 1.1], 'multiplier_ci95': [ci, [0.0, 9.0]]}
  assert ladder_report.verdict_reading(m) == {
    'loss': 1.8,
    'multiplier': 1.0,
    'multiplier_ci95': ci,
    'reading': reading,
  }
  assert ladder_report.verdict_reading({'losses': [], 'multiplier': [], 'multiplier_ci95': []}) is None


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
