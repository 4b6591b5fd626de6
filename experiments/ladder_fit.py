"""Scaling-law fits of a ladder and the compute multiplier between two of them (docs/scaling_ladders.md).

- `fit_power_law`: L = A * C^-alpha by least squares on log L = log A - alpha log C (Moonlight's
  and Kimi Linear's form); standard errors from the fit's residuals, 95% intervals from Student's t
  with n - 2 degrees of freedom.
- `fit_power_law_offset`: L = E + A * C^-alpha (marin's form with an irreducible loss E), for
  n >= 4 rungs: E profiled on a grid in [0, min(L)) (for each E the rest is a log-log line), then
  refined by Gauss-Newton with step halving inside that range; intervals from the Jacobian at the
  optimum with n - 3 degrees of freedom (with 4 rungs only one: wide, as they should be). Rungs
  that bend the wrong way for a floor put E at 0 (`E_at_zero`): the pure power law then.
- `compute_multiplier`: C_base(L*) / C_var(L*) at matched loss L* from the two fits, over the
  range of L* both ladders' rungs cover (flagged as extrapolation when they do not overlap), with a
  95% interval by sampling the fits' parameters from their Gaussian approximation (fixed seed).

C is in PFLOP/s-days (1 = 8.64e19 FLOPs), as the reports plot it; alpha does not depend on the
unit, A does. numpy only.
"""

from __future__ import annotations

import math

import numpy as np

PFLOPS_DAY = 1e15 * 86400.0

# Student's t, two-sided 95% (0.975 quantile), by degrees of freedom; the normal 1.96 beyond.
_T975 = {
  1: 12.706,
  2: 4.303,
  3: 3.182,
  4: 2.776,
  5: 2.571,
  6: 2.447,
  7: 2.365,
  8: 2.306,
  9: 2.262,
  10: 2.228,
  12: 2.179,
  15: 2.131,
  20: 2.086,
  30: 2.042,
}


def t975(dof: int) -> float:
  """The 0.975 quantile of Student's t (conservative between table entries: the next lower dof)."""
  if dof < 1:
    return float('inf')
  if dof > 30:
    return 1.96
  return _T975[max(d for d in _T975 if d <= dof)]


def _check(c, loss, min_points: int):
  c, loss = np.asarray(c, np.float64), np.asarray(loss, np.float64)
  if c.shape != loss.shape or c.ndim != 1:
    raise ValueError(f'compute and loss must be 1-D of one length; got {c.shape} and {loss.shape}')
  if len(c) < min_points:
    raise ValueError(f'this fit needs >= {min_points} rungs; got {len(c)}')
  if np.any(c <= 0) or np.any(loss <= 0) or not np.all(np.isfinite(c * loss)):
    raise ValueError('compute and loss must be positive and finite')
  return c, loss


def fit_power_law(c, loss) -> dict:
  """L = A * C^-alpha. Returns A, alpha, their standard errors and 95% intervals, the covariance of
  (log A, alpha), the residual RMS in log L and the number of points."""
  c, loss = _check(c, loss, 2)
  x, y = np.log(c), np.log(loss)
  design = np.stack([np.ones_like(x), -x], axis=1)  # y = log A - alpha x
  theta, *_ = np.linalg.lstsq(design, y, rcond=None)
  resid = y - design @ theta
  dof = len(x) - 2
  sigma2 = float(resid @ resid / dof) if dof > 0 else float('nan')
  cov = sigma2 * np.linalg.inv(design.T @ design)
  se = np.sqrt(np.diag(cov))
  t = t975(dof)
  log_a, alpha = float(theta[0]), float(theta[1])
  return {
    'form': 'A*C^-alpha',
    'A': math.exp(log_a),
    'alpha': alpha,
    'log_A': log_a,
    'alpha_se': float(se[1]),
    'alpha_ci95': [alpha - t * se[1], alpha + t * se[1]],
    'A_ci95': [math.exp(log_a - t * se[0]), math.exp(log_a + t * se[0])],
    'cov_logA_alpha': cov.tolist(),
    'rms_log_residual': float(np.sqrt(np.mean(resid**2))),
    'n': len(x),
    'dof': dof,
  }


def _offset_model(theta, x):
  e, log_a, alpha = theta
  return e + np.exp(log_a - alpha * x)


def _offset_jacobian(theta, x):
  e, log_a, alpha = theta
  p = np.exp(log_a - alpha * x)
  return np.stack([np.ones_like(x), p, -x * p], axis=1)


def fit_power_law_offset(c, loss, grid: int = 400) -> dict:
  """L = E + A * C^-alpha (n >= 4). Returns E, A, alpha with standard errors and 95% intervals."""
  c, loss = _check(c, loss, 4)
  x = np.log(c)
  best = None
  for e in np.linspace(0.0, loss.min(), grid, endpoint=False):  # profile over E < min L
    p = fit_power_law(c, loss - e)
    sse = float(np.sum((loss - _offset_model((e, p['log_A'], p['alpha']), x)) ** 2))
    if best is None or sse < best[0]:
      best = (sse, np.array([e, p['log_A'], p['alpha']]))
  sse, theta = best
  for _ in range(100):  # Gauss-Newton with step halving
    resid = loss - _offset_model(theta, x)
    jac = _offset_jacobian(theta, x)
    step, *_ = np.linalg.lstsq(jac, resid, rcond=None)
    scale, improved = 1.0, False
    while scale > 1e-6:
      cand = theta + scale * step
      cand_sse = float(np.sum((loss - _offset_model(cand, x)) ** 2))
      if 0.0 <= cand[0] < loss.min() and cand_sse < sse:  # an irreducible loss is >= 0
        theta, improved = cand, sse - cand_sse > 1e-15 * max(sse, 1e-300)
        sse = cand_sse
        break
      scale /= 2
    if not improved:
      break
  dof = len(x) - 3
  jac = _offset_jacobian(theta, x)
  sigma2 = sse / dof if dof > 0 else float('nan')
  try:
    cov = sigma2 * np.linalg.inv(jac.T @ jac)
  except np.linalg.LinAlgError:
    cov = np.full((3, 3), np.nan)
  se = np.sqrt(np.abs(np.diag(cov)))
  t = t975(dof)
  e, log_a, alpha = (float(v) for v in theta)
  return {
    'form': 'E+A*C^-alpha',
    'E': e,
    'E_at_zero': e == 0.0,
    'A': math.exp(log_a),
    'alpha': alpha,
    'log_A': log_a,
    'E_se': float(se[0]),
    'alpha_se': float(se[2]),
    'E_ci95': [e - t * se[0], e + t * se[0]],
    'alpha_ci95': [alpha - t * se[2], alpha + t * se[2]],
    'cov_E_logA_alpha': cov.tolist(),
    'rms_residual': float(np.sqrt(sse / len(x))),
    'n': len(x),
    'dof': dof,
  }


def compute_at_loss(fit: dict, loss) -> np.ndarray:
  """C at which `fit` predicts `loss` (NaN where it never reaches it)."""
  loss = np.asarray(loss, np.float64)
  base = loss - fit.get('E', 0.0)
  with np.errstate(invalid='ignore', divide='ignore', over='ignore'):
    return np.where(base > 0, (np.maximum(base, 1e-300) / fit['A']) ** (-1.0 / fit['alpha']), np.nan)


def predict(fit: dict, c) -> np.ndarray:
  return fit.get('E', 0.0) + fit['A'] * np.asarray(c, np.float64) ** -fit['alpha']


def _samples(fit: dict, rng: np.random.Generator, n: int) -> list[dict]:
  """Draws of the pure power-law fit's (log A, alpha) from its Gaussian approximation."""
  cov = np.asarray(fit['cov_logA_alpha'])
  if not np.all(np.isfinite(cov)):
    return []
  draws = rng.multivariate_normal([fit['log_A'], fit['alpha']], cov, size=n)
  return [{'A': math.exp(a), 'alpha': b} for a, b in draws if b > 0]


def compute_multiplier(
  base_fit: dict, var_fit: dict, base_losses, var_losses, *, points: int = 3, samples: int = 4000, seed: int = 0
) -> dict:
  """C_base(L*) / C_var(L*) (> 1: the variant reaches L* with less compute) at `points` losses
  spread over the range both ladders cover, [max of the two minima, min of the two maxima]; with no
  overlap, at the two ladders' nearest ends, marked extrapolated. Intervals (95%) from the pure
  power-law fits' parameter uncertainty."""
  if base_fit['alpha'] <= 0 or var_fit['alpha'] <= 0:
    return {
      'losses': [],
      'multiplier': [],
      'multiplier_ci95': [],
      'loss_range': [float('nan')] * 2,
      'extrapolated': False,
      'note': 'undefined: a fit does not fall with compute (alpha <= 0)',
    }
  lo = max(min(base_losses), min(var_losses))
  hi = min(max(base_losses), max(var_losses))
  extrapolated = lo > hi
  if extrapolated:
    lo, hi = hi, lo
  targets = np.geomspace(lo, hi, points) if points > 1 else np.array([math.sqrt(lo * hi)])
  ratio = compute_at_loss(base_fit, targets) / compute_at_loss(var_fit, targets)
  rng = np.random.default_rng(seed)
  pairs = list(zip(_samples(base_fit, rng, samples), _samples(var_fit, rng, samples)))
  ci = []
  for target in targets:
    with np.errstate(invalid='ignore', divide='ignore', over='ignore'):
      draws = [compute_at_loss(b, target) / compute_at_loss(v, target) for b, v in pairs]
    draws = np.asarray([d for d in draws if np.isfinite(d)])
    ci.append(
      [float(np.quantile(draws, 0.025)), float(np.quantile(draws, 0.975))]
      if len(draws) > 10
      else [float('nan'), float('nan')]
    )
  return {
    'losses': targets.tolist(),
    'multiplier': ratio.tolist(),
    'multiplier_ci95': ci,
    'loss_range': [lo, hi],
    'extrapolated': bool(extrapolated),
  }
