"""Run a scaling ladder (configs/ladder.py), fit L(C) per variant and report compute multipliers.

    python -m experiments.scaling_ladder --config=configs/ladder.py:smoke --workdir=DIR \\
        [--variants=adamw,muon] [--time_budget_s=540] [--publish=experiments/results/NAME]

Every rung of every variant (configs/ladder.py: widths tied to depth and heads by a stated rule,
tokens per parameter and lr per rung) trains through kimijax.train.loop.train in
DIR/<variant>/<rung>/; finished rungs are reused and half-finished ones resume from their
checkpoints, so a ladder can be finished over several calls or machines by bringing DIR back
(ladder.json alone is not enough: the run folders hold the curves). Before each rung it prints
"rung n of m" with its size and an ETA from the FLOP rate of the rungs trained in this call.
--variants runs a subset (e.g. one variant per 10-minute GPU call); --time_budget_s starts no rung
that the measured FLOP rate says would end past the budget (the report then covers what is done);
--report_only trains nothing and rewrites the report from the finished rungs. Each run's done.json
records its hardware and training-split size, so a report written elsewhere states where the
rungs ran and how many epochs they saw. --from_json=PATH rewrites the report from a ladder.json
alone (no run folders; --config not needed), keeping its date and hardware; for a ladder.json from
before the model / optimizer split it counts the split again from configs/ladder.py where that
count reproduces each rung's recorded FLOPs exactly, and says which rungs it cannot.

Training FLOPs per rung come from kimijax.train.flops (the count bench_train's MFU uses): model
FLOPs (6 N_active + attention + KDA state products per token) and optimizer FLOPs (Muon's
Newton-Schulz per step, on every expert's matrices, active or not). C, in PFLOP/s-days, is counted
both ways, as model FLOPs (the count of the Moonlight, Kimi Linear and Attention Residuals
reports, and the one the verdict reads) and as model + optimizer FLOPs. Per count and variant it
fits L = A C^-alpha (log-log least squares) and, with >= 4 rungs, L = E + A C^-alpha
(experiments/ladder_fit.py), and writes

  DIR/ladder.json   rungs (params, tokens, steps, lr, model / optimizer / total FLOPs, eval loss,
                    epochs of data seen, loss by position), fits and multipliers per count of C
                    (exponent with 95% interval), the verdict's reading of each multiplier
  DIR/ladder.md     the rung table, the fits, each variant's compute multiplier against the
                    baseline at matched loss C_base(L*) / C_var(L*) over the loss range the rungs
                    of both cover (marked when that needs extrapolation) on each count of C, and
                    the verdict's basis: the multiplier on model FLOPs at the largest rungs' loss
  DIR/ladder.png    eval loss against compute, log-log, rungs and fits per variant: one panel per
                    count of C (one alone where the two are equal, i.e. no Muon)

Expected (smoke, 2-core CPU): 6 runs in about 10 min, muon below adamw at every rung, and muon's
multiplier over adamw in ladder.md (the Moonlight report's "52% of the FLOPs" would read 1.92x on
model FLOPs); every figure: experiments/results/ladder_smoke.md.
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import ml_collections

from experiments import ladder_fit, runs as runs_lib
from experiments.runs import WorkflowError


def rung_config(ladder: ml_collections.ConfigDict, rung: dict, overrides=(), steps: int = 1):
  """The kimijax config of one rung of one variant, trained for `steps` steps."""
  from kimijax.config import validate

  every = max(steps // 4, 1)
  c = runs_lib.with_overrides(
    ladder.base,
    {
      'model.d_model': rung['d_model'],
      'model.num_layers': rung['num_layers'],
      'model.num_heads': rung['num_heads'],
      'model.mlp_dim': rung['mlp_dim'],
      'optimizer.learning_rate': float(rung['learning_rate']),
      'train.batch_size': rung['batch_size'],
      'train.steps': steps,
      'train.eval_every': every,
      'train.checkpoint_every': every,
      'optimizer.warmup_steps': max(steps // 20, 1),
      'optimizer.schedule': 'cosine',
      'optimizer.min_lr_ratio': 0.1,
      **dict(overrides),
    },
  )
  return validate(c)


def planned_rungs(ladder: ml_collections.ConfigDict) -> list[dict]:
  """[{variant, rung, config, step_flops}] for every rung of every variant, in run order (variant
  by variant, small rungs first); every config validated, nothing read or written."""
  from kimijax.train import flops as flops_lib

  if ladder.baseline not in ladder.variants:
    raise WorkflowError(
      f'ladder {ladder.name!r}: baseline {ladder.baseline!r} is not one of its variants {list(ladder.variants)}'
    )
  steps_of = {}
  for rung in ladder.rungs:  # tokens from the baseline's active parameter count: the same for all variants
    probe = rung_config(ladder, rung, ladder.variants[ladder.baseline])
    n = flops_lib.active_count(probe)
    tokens_per_step = rung['batch_size'] * probe.train.seq_len
    steps_of[rung['name']] = max(math.ceil(ladder.tokens_per_param * n / tokens_per_step), 1)
  out = []
  for v in ladder.variants:
    for rung in ladder.rungs:
      c = rung_config(ladder, rung, ladder.variants[v], steps_of[rung['name']])
      out.append({'variant': v, 'rung': dict(rung), 'config': c, 'step_flops': flops_lib.training_flops_per_step(c)})
  return out


def plan(ladder: ml_collections.ConfigDict, workdir: pathlib.Path, variants: list[str] | None = None) -> list[dict]:
  """planned_rungs with {run_dir, chosen}: `chosen` marks those of `variants` (default all), the
  ones to train. All configs are validated and run folders checked before any training."""
  chosen = list(ladder.variants) if not variants else variants
  for v in chosen:
    if v not in ladder.variants:
      raise WorkflowError(
        f'--variants: {v!r} is not a variant of ladder {ladder.name!r}; allowed: {list(ladder.variants)}'
      )
  out = []
  for r in planned_rungs(ladder):
    run_dir = workdir / r['variant'] / r['rung']['name']
    runs_lib.check_folder(run_dir, r['config'])
    out.append({**r, 'run_dir': run_dir, 'chosen': r['variant'] in chosen})
  return out


def rung_time_model(trained: list[tuple[float, float, float]]) -> tuple[float, float] | None:
  """(seconds of overhead per rung, seconds per FLOP) from the (FLOPs, wall seconds, training seconds)
  of the rungs trained in this call, the training seconds being tokens / the median logged tokens/s.
  Overhead (compilation, data loading, evals) is the mean of wall - training. Seconds per FLOP is
  the slope between the two largest rungs (small models run at a far lower FLOP rate than large
  ones, so the rate of one small rung alone would predict large rungs many times too long), or
  the one rung's rate."""
  if not trained:
    return None
  overhead = sum(max(wall - train, 0.0) for _, wall, train in trained) / len(trained)
  by_flops = sorted(trained)
  (f1, _, t1), (f2, _, t2) = by_flops[-2:] if len(by_flops) >= 2 else (by_flops[-1],) * 2
  per_flop = (t2 - t1) / (f2 - f1) if f2 > f1 and t2 > t1 else t2 / f2
  return overhead, per_flop


def predict_seconds(model: tuple[float, float] | None, flops: list[float]) -> float | None:
  if model is None:
    return None
  return sum(model[0] + model[1] * f for f in flops)


def eta_text(seconds: float | None) -> str:
  if seconds is None:
    return 'ETA after the first rung trained in this call'
  return f'ETA {seconds / 60:.1f} min for this and the remaining rungs'


# The two counts of a rung's training compute C (docs/scaling_ladders.md#compute), by the rung's key
# holding it: 'model', the model's forward and backward (what the Moonlight, Kimi Linear and
# Attention Residuals reports count), and 'total', model + the optimizer's (Muon's Newton-Schulz).
# The verdict reads the multiplier on VERDICT_COMPUTE.
COMPUTE = {'model': 'model FLOPs', 'total': 'model + optimizer FLOPs'}
COMPUTE_KEY = {'model': 'model_flops', 'total': 'flops'}
VERDICT_COMPUTE = 'model'


def fits_for(points: list[dict], compute: str = 'total') -> dict:
  """Fits of one variant's finished rungs (C in PFLOP/s-days against final eval loss), C counted as
  `compute` (a COMPUTE key); rungs that do not hold that count (a ladder.json from before the split)
  are left out."""
  points = [p for p in points if p.get(COMPUTE_KEY[compute]) is not None]
  c = [p[COMPUTE_KEY[compute]] / ladder_fit.PFLOPS_DAY for p in points]
  loss = [p['final_eval_loss'] for p in points]
  out = {}
  if len(points) >= 2:
    out['power_law'] = ladder_fit.fit_power_law(c, loss)
  if len(points) >= 4:
    out['with_offset'] = ladder_fit.fit_power_law_offset(c, loss)
  return out


def _params_cell(r: dict) -> str:
  """The rung table's parameter count: total, and the active count where it differs (MoE)."""
  active = r.get('active_params', r['params'])
  return f'{r["params"]:,}' + (f' ({active:,} active)' if active != r['params'] else '')


def _params_text(step_flops: dict) -> str:
  """'N params', and ', M active' where they differ (MoE), for the line before each rung."""
  n, active = step_flops['params'], step_flops['active_params']
  return f'{n:,} params' + (f', {active:,} active' if active != n else '')


def _rung_row(r: dict) -> dict:
  figs = r['figures']
  step_flops = r['step_flops']  # of the rung's config (kimijax.train.flops), as figs['flops']
  return {
    'variant': r['variant'],
    'rung': r['rung']['name'],
    'd_model': r['rung']['d_model'],
    'num_layers': r['config'].model.num_layers,
    'num_heads': r['rung']['num_heads'],
    'batch_size': r['rung']['batch_size'],
    'learning_rate': r['rung']['learning_rate'],
    **{k: figs[k] for k in ('params', 'active_params', 'tokens', 'steps', 'flops')},
    'model_flops': step_flops['model'] * figs['steps'],
    'optimizer_flops': step_flops['optimizer'] * figs['steps'],
    **{
      k: figs[k]
      for k in (
        'final_eval_loss',
        'final_train_loss',
        'epochs',
        'tokens_per_sec',
        'wall_seconds',
        'loss_by_position',
        'run_dir',
        'hardware',
      )
    },
  }


def verdict_reading(m: dict) -> dict | None:
  """The multiplier at the largest rungs' loss (the lowest L* of the range, where both variants'
  largest rungs are) and what its 95% interval says against 1: 'less compute' (above 1), 'more
  compute' (below 1), 'inside the noise' (containing 1) or 'undefined'."""
  if not m['multiplier']:
    return None
  x, ci = m['multiplier'][0], m['multiplier_ci95'][0]
  if ci is None or any(v is None or v != v for v in ci):
    reading = 'undefined'
  elif ci[0] > 1:
    reading = 'less compute'
  elif ci[1] < 1:
    reading = 'more compute'
  else:
    reading = 'inside the noise'
  return {'loss': m['losses'][0], 'multiplier': x, 'multiplier_ci95': ci, 'reading': reading}


def analyse(ladder, rows: list[dict]) -> dict:
  """Per compute count (COMPUTE): fits per variant and multipliers of every variant against the
  baseline; and the verdict's reading of each variant's multiplier on VERDICT_COMPUTE."""
  by_variant = {}
  for row in rows:
    by_variant.setdefault(row['variant'], []).append(row)
  base = ladder.baseline
  fits, multipliers = {}, {}
  for compute in COMPUTE:
    fits[compute] = {v: fits_for(pts, compute) for v, pts in by_variant.items()}
    multipliers[compute] = {}
    for v in by_variant:
      fb, fv = fits[compute].get(base, {}), fits[compute][v]
      if v == base or 'power_law' not in fb or 'power_law' not in fv:
        continue
      key = COMPUTE_KEY[compute]
      multipliers[compute][v] = ladder_fit.compute_multiplier(
        fb['power_law'],
        fv['power_law'],
        [p['final_eval_loss'] for p in by_variant[base] if p.get(key) is not None],
        [p['final_eval_loss'] for p in by_variant[v] if p.get(key) is not None],
      )
  verdict = {v: verdict_reading(m) for v, m in multipliers[VERDICT_COMPUTE].items()}
  return {'fits': fits, 'multipliers': multipliers, 'verdict_compute': VERDICT_COMPUTE, 'verdict': verdict}


def _ci(pair) -> str:
  return '-' if pair is None or any(x != x for x in pair) else f'[{pair[0]:.4g}, {pair[1]:.4g}]'


def shown_computes(rows: list[dict]) -> list[str]:
  """The counts of C that the report shows (COMPUTE keys, the verdict's first): both; 'model' alone
  where no rung has optimizer FLOPs (the two are then equal); 'total' alone where no rung holds the
  split (a ladder.json from before it)."""
  if rows and all(r.get('model_flops') is None for r in rows):
    return ['total']
  if rows and all(r.get('optimizer_flops') == 0 for r in rows):
    return ['model']
  return ['model', 'total']


def _compute_label(compute: str, shown: list[str]) -> str:
  if shown == ['model']:
    return 'model (= model + optimizer: no optimizer FLOPs)'
  return {'model': 'model', 'total': 'model + optimizer'}[compute]


def _flops_cells(r: dict) -> str:
  """'model FLOPs | optimizer FLOPs (share of C) | C model / total (PF-days)', '-' where not held."""
  model, opt, total = r.get('model_flops'), r.get('optimizer_flops'), r['flops']
  day = ladder_fit.PFLOPS_DAY
  opt_cell = '-' if opt is None else f'{opt:.3g} ({100 * opt / total:.0f}%)' if opt else '0'
  model_cells = ('-', '-') if model is None else (f'{model:.3g}', f'{model / day:.3g}')
  return f'{model_cells[0]} | {opt_cell} | {model_cells[1]} / {total / day:.3g}'


def _verdict_lines(ladder, analysis) -> list[str]:
  rule = (
    'Verdict basis: the multiplier on C = model FLOPs (the count of the Moonlight, Kimi Linear and '
    "Attention Residuals reports, so the one to set beside their multipliers) at the largest rungs' "
    'loss (the first L* of its row). Its 95% interval above 1: the variant needs less compute than '
    f'`{ladder.baseline}`; below 1: more; containing 1: inside the noise. Against a published '
    'multiplier: an interval that contains it and excludes 1 reproduces it, one that contains both '
    'is inside the noise, one that excludes it refutes it.'
  )
  lines = [rule, '']
  for v, reading in analysis['verdict'].items():
    if reading is None:
      lines.append(f'- `{v}`: undefined ({analysis["multipliers"][VERDICT_COMPUTE][v].get("note", "no multiplier")})')
    else:
      lines.append(
        f'- `{v}` at L* = {reading["loss"]:.3f}: **{reading["multiplier"]:.3g}x** '
        f'{_ci(reading["multiplier_ci95"])}: {reading["reading"]}'
      )
  if not analysis['verdict']:
    lines.append(
      '- no reading: needs >= 2 finished rungs of the baseline and of a variant, each with its model FLOPs '
      '(a ladder.json from before the model/optimizer split has only their sum)'
    )
  return lines


def markdown(ladder, rows, analysis, prov, png_name: str, planned: int, notes: list[str] = ()) -> str:
  trained_on = sorted({r.get('hardware') or 'not recorded' for r in rows})
  where = '; '.join(trained_on) if trained_on else prov['hardware']
  if trained_on and trained_on != [prov['hardware']]:
    written_by = f' by `{prov["ladder_command"]}`' if prov.get('ladder_command') else ''
    where += (
      f' (their ladder.json was written on {prov["hardware"]}{written_by})'
      if 'not recorded' in trained_on and written_by
      else f' (report written on {prov["hardware"]})'
    )
  shown = shown_computes(rows)
  lines = [
    f'# Scaling ladder `{ladder.name}`',
    '',
    f'Date: {prov["date"]}. Rungs trained on: {where}. {len(rows)} of {planned} rungs finished.',
    '',
    'Command:',
    '',
    f'    {prov["command"]}',
    '',
    f'Rule: {ladder.rule}; {ladder.tokens_per_param:g} tokens per parameter; baseline '
    f'`{ladder.baseline}`; variants: '
    + '; '.join(f'`{v}` = ' + (', '.join(f'{k}={val}' for k, val in o) or 'base') for v, o in ladder.variants.items()),
    '',
    '| variant | rung | d | layers | heads | params | batch | lr | steps | tokens | epochs | '
    'model FLOPs | optimizer FLOPs (share of total) | C (PF-days): model / total | final eval loss | '
    'final train loss | tokens/s | wall s |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    epochs = '-' if r['epochs'] is None else f'{r["epochs"]:.3g}'
    rate = '-' if not r['tokens_per_sec'] else f'{r["tokens_per_sec"]:,.0f}'
    wall = '-' if not r['wall_seconds'] else f'{r["wall_seconds"]:.0f}'
    lines.append(
      f'| {r["variant"]} | {r["rung"]} | {r["d_model"]} | {r["num_layers"]} | {r["num_heads"]} | '
      f'{_params_cell(r)} | {r["batch_size"]} | {r["learning_rate"]:.4g} | {r["steps"]} | {r["tokens"]:,} | '
      f'{epochs} | {_flops_cells(r)} | '
      f'{r["final_eval_loss"]:.4f} | {r["final_train_loss"]:.4f} | {rate} | {wall} |'
    )
  for note in notes:
    lines += ['', note]
  lines += [
    '',
    '## Fits (C in PFLOP/s-days, loss = final eval loss in nats per token)',
    '',
    '| C counts | variant | form | A | alpha | alpha 95% interval | E (95% interval) | rungs | residual RMS |',
    '|---|---|---|---|---|---|---|---|---|',
  ]
  for compute in shown:
    label = _compute_label(compute, shown)
    for v, fits in analysis['fits'][compute].items():
      if 'power_law' in fits:
        f = fits['power_law']
        lines.append(
          f'| {label} | {v} | A C^-alpha | {f["A"]:.4g} | {f["alpha"]:.4f} | '
          f'{_ci(f["alpha_ci95"]) if f["dof"] > 0 else "- (2 rungs)"} '
          f'| - | {f["n"]} | {f["rms_log_residual"]:.2g} (log L) |'
        )
      if 'with_offset' in fits:
        f = fits['with_offset']
        lines.append(
          f'| {label} | {v} | E + A C^-alpha | {f["A"]:.4g} | {f["alpha"]:.4f} | {_ci(f["alpha_ci95"])} | '
          f'{f["E"]:.4f} '
          + ('(at its bound 0: no floor in these rungs)' if f.get('E_at_zero') else _ci(f['E_ci95']))
          + f' | {f["n"]} | {f["rms_residual"]:.2g} |'
        )
  lines += [
    '',
    f'## Compute multiplier against `{ladder.baseline}` at matched loss',
    '',
    'C_base(L*) / C_var(L*) from the two A C^-alpha fits of one count of C: above 1 the variant '
    'reaches L* with less compute (Moonlight\'s "Muon needs ~52% of the FLOPs" is 1.92x; Kimi Linear '
    "reports 1.16x, Attention Residuals 1.25x, all on model FLOPs). 95% intervals from the fits' "
    'parameter uncertainty.',
    '',
    '| variant | C counts | L* range | multiplier at L* (95% interval) | extrapolated |',
    '|---|---|---|---|---|',
  ]
  for v in analysis['multipliers'][shown[0]]:
    for compute in shown:
      m = analysis['multipliers'][compute].get(v)
      if m is None:
        continue
      cells = '; '.join(
        f'{loss:.3f}: **{x:.3g}x** {_ci(ci)}' for loss, x, ci in zip(m['losses'], m['multiplier'], m['multiplier_ci95'])
      )
      note = "yes: the variants' loss ranges do not overlap" if m['extrapolated'] else 'no'
      if 'note' in m:
        cells, note = m['note'], '-'
      lines.append(
        f'| {v} | {_compute_label(compute, shown)} | {m["loss_range"][0]:.3f}-{m["loss_range"][1]:.3f} | '
        f'{cells} | {note} |'
      )
  if not analysis['multipliers'][shown[0]]:
    lines.append('| - | - | - | needs >= 2 finished rungs of the baseline and of a variant | - |')
  lines += ['', *_verdict_lines(ladder, analysis)]
  lines += [
    '',
    f'![loss against compute]({png_name})',
    '',
    'FLOPs: kimijax.train.flops. Model FLOPs: 6 N_active + causal attention + KDA state products per '
    "token, forward and backward. Optimizer FLOPs: Muon's Newton-Schulz per step, on every Muon matrix "
    "(an MoE layer's every expert, active or not; 0 for AdamW). C: either count in PF-days. Epochs: "
    'tokens trained / tokens in the training split. Wall time includes compilation and evals; '
    'tokens/s is the median logged rate.',
  ]
  return '\n'.join(lines) + '\n'


def plot(ladder, rows, analysis, out: pathlib.Path) -> pathlib.Path:
  """Eval loss against C, log-log, rungs and fits per variant: one panel per count of C the report
  shows (shown_computes), model FLOPs first."""
  import matplotlib
  import matplotlib.ticker

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  shown = shown_computes(rows)
  fig, axes = plt.subplots(1, len(shown), figsize=(7.5 * len(shown), 5), sharey=True, squeeze=False)
  variants = list(dict.fromkeys(r['variant'] for r in rows))
  for ax, compute in zip(axes[0], shown):
    key = COMPUTE_KEY[compute]
    for i, v in enumerate(variants):
      pts = [r for r in rows if r['variant'] == v and r.get(key) is not None]
      if not pts:
        continue
      c = np.array([r[key] / ladder_fit.PFLOPS_DAY for r in pts])
      loss = np.array([r['final_eval_loss'] for r in pts])
      ax.plot(c, loss, 'o', color=f'C{i}', label=f'{v} rungs')
      grid = np.geomspace(c.min() / 1.5, c.max() * 1.5, 100)
      fits = analysis['fits'][compute].get(v, {})
      if 'power_law' in fits:
        f = fits['power_law']
        ax.plot(
          grid,
          ladder_fit.predict(f, grid),
          '-',
          color=f'C{i}',
          lw=1.2,
          label=f'{v}: {f["A"]:.3g} C^-{f["alpha"]:.4f}',
        )
      if 'with_offset' in fits:
        f = fits['with_offset']
        ax.plot(
          grid,
          ladder_fit.predict(f, grid),
          '--',
          color=f'C{i}',
          lw=1,
          label=f'{v}: {f["E"]:.3g} + {f["A"]:.3g} C^-{f["alpha"]:.3f}',
        )
    title = f'C = {COMPUTE[compute]}' + (" (the verdict's)" if compute == VERDICT_COMPUTE else '')
    ax.set(
      xscale='log',
      yscale='log',
      xlabel='training compute C (PFLOP/s-days)',
      title=title + (': no optimizer FLOPs, so = model + optimizer' if shown == ['model'] else ''),
    )
    ax.grid(alpha=0.3, which='both')
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # losses as plain numbers
    ax.yaxis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel('final eval loss (nats/token)')
  fig.suptitle(
    f'ladder {ladder.name}: {len(rows)} rungs; fits by least squares (experiments/ladder_fit.py)', fontsize=9
  )
  fig.savefig(out, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return out


def run_ladder(
  ladder: ml_collections.ConfigDict,
  workdir: str | pathlib.Path,
  *,
  variants=None,
  time_budget_s: float | None = None,
  publish: str | None = None,
  devices=None,
  drop_checkpoints: bool = False,
  report_only: bool = False,
) -> dict:
  """Runs (or resumes) the ladder's rungs, then writes ladder.json / .md / .png; returns the json data.
  report_only=True trains nothing: the report covers the rungs finished in workdir."""
  workdir = pathlib.Path(workdir)
  planned = plan(ladder, workdir, variants)
  runs = [] if report_only else [r for r in planned if r['chosen']]
  started = time.time()
  trained, finished = [], []  # (FLOPs, wall s, training s) of each rung trained in this call
  for run in planned:  # finished rungs of the variants not run now still go into the report
    if all(run is not r for r in runs) and runs_lib.is_finished(run['run_dir']):
      finished.append({**run, 'figures': runs_lib.read_run(run['config'], run['run_dir'])})
  for n, run in enumerate(runs, 1):
    total = run['step_flops']['total'] * run['config'].train.steps
    remaining = [
      r['step_flops']['total'] * r['config'].train.steps
      for r in runs[n - 1 :]
      if not runs_lib.is_finished(r['run_dir'])
    ]
    model = rung_time_model(trained)
    was_finished = runs_lib.is_finished(run['run_dir'])
    if not was_finished and time_budget_s is not None:
      this_rung = predict_seconds(model, [total])
      if this_rung is not None and time.time() - started + this_rung > time_budget_s:
        print(
          f'ladder: stopping before rung {n} of {len(runs)}: it would take ~{this_rung:.0f} s and end past '
          f'the {time_budget_s:.0f} s budget; re-run the same command to continue',
          flush=True,
        )
        break
    print(
      f'ladder: rung {n} of {len(runs)}: {run["variant"]} {run["rung"]["name"]} '
      f'({_params_text(run["step_flops"])}, {run["config"].train.steps} steps, {total:.3g} FLOPs); '
      f'{eta_text(predict_seconds(model, remaining))}',
      flush=True,
    )
    began = time.time()
    figures = runs_lib.train_run(run['config'], run['run_dir'], devices=devices, drop_checkpoints=drop_checkpoints)
    if not was_finished:
      wall = time.time() - began
      rate = figures.get('tokens_per_sec')
      trained.append((total, wall, min(figures['tokens'] / rate, wall) if rate else wall))
    finished.append({**run, 'figures': figures})
  finished.sort(key=lambda r: [p['run_dir'] for p in planned].index(r['run_dir']))
  rows = [_rung_row(r) for r in finished]
  return write_report(ladder, rows, len(planned), workdir, publish, started)


def write_report(
  ladder,
  rows: list[dict],
  planned: int,
  workdir: pathlib.Path,
  publish: str | None,
  started: float,
  *,
  prov: dict | None = None,
  notes: list[str] = (),
):
  """Fits the rungs' rows and writes workdir/ladder.json / .md / .png (and publishes them); returns
  the json data. prov: the header's date, hardware and command (default: this call's); notes:
  lines for the report under the rung table."""
  analysis = analyse(ladder, rows)
  prov = prov or runs_lib.provenance()
  workdir.mkdir(parents=True, exist_ok=True)
  png = plot(ladder, rows, analysis, workdir / 'ladder.png') if rows else None
  md = workdir / 'ladder.md'
  md.write_text(markdown(ladder, rows, analysis, prov, png.name if png else '', planned, notes))
  data = {
    'ladder': ladder.name,
    **prov,
    'rule': ladder.rule,
    'tokens_per_param': ladder.tokens_per_param,
    'baseline': ladder.baseline,
    'variants': {v: list(map(list, o)) for v, o in ladder.variants.items()},
    'compute': COMPUTE,
    'rungs': rows,
    **analysis,
    'planned_rungs': planned,
    'finished_rungs': len(rows),
  }
  js = workdir / 'ladder.json'
  js.write_text(runs_lib.to_json(data))
  print(md.read_text())
  print(f'wrote {md}, {js}' + (f', {png}' if png else '') + f' in {time.time() - started:.0f} s')
  if publish and png:
    for path in runs_lib.publish({'.md': md, '.png': png, '.json': js}, publish):
      print(f'published {path}')
  return data


# A rung's recorded C (model + optimizer FLOPs) and the plan's count of it agree to this relative
# difference where the plan counts the rung's config (the same float sum, in another order at most).
SPLIT_TOLERANCE = 1e-9


def split_from_plan(data: dict, ladder_file: str = 'configs/ladder.py') -> tuple[dict, str | None]:
  """The model / optimizer split of the rungs of a ladder.json that hold only its sum ('flops'),
  counted again where that is exact: ladder_file's ladder of the json's name is planned, and a rung
  whose variant and rung it plans with the same steps and parameters, and whose planned FLOPs x
  steps equal its recorded 'flops' (SPLIT_TOLERANCE), takes the plan's model and optimizer FLOPs
  and active parameters. Returns ({(variant, rung): those three}, a line naming the rungs left
  without the split and why, None where none is)."""
  from kimijax.config import ConfigError, load_file

  lacking = [r for r in data['rungs'] if r.get('model_flops') is None]
  if not lacking:
    return {}, None
  spec = f'{ladder_file}:{data["ladder"]}'
  head = f"Model and optimizer FLOPs '-': the ladder.json holds only their sum, and {spec}"
  try:
    planned = {(p['variant'], p['rung']['name']): p for p in planned_rungs(load_file(spec))}
  except (ConfigError, WorkflowError) as e:
    return {}, f'{head} does not plan its rungs ({e}).'
  split, why = {}, []
  for r in lacking:
    p = planned.get((r['variant'], r['rung']))
    if p is None:
      why.append(f'{r["variant"]} {r["rung"]}: not planned')
      continue
    steps, step_flops = p['config'].train.steps, p['step_flops']
    counted = step_flops['total'] * steps
    if steps != r['steps'] or step_flops['params'] != r['params']:
      why.append(
        f'{r["variant"]} {r["rung"]}: planned steps={steps}, params={step_flops["params"]}; '
        f'recorded steps={r["steps"]}, params={r["params"]}'
      )
    elif abs(counted - r['flops']) > SPLIT_TOLERANCE * abs(r['flops']):
      why.append(
        f'{r["variant"]} {r["rung"]}: planned {counted:.12g} FLOPs, recorded {r["flops"]:.12g} '
        f'(relative difference {abs(counted - r["flops"]) / r["flops"]:.2g})'
      )
    else:
      split[r['variant'], r['rung']] = {
        'model_flops': step_flops['model'] * steps,
        'optimizer_flops': step_flops['optimizer'] * steps,
        'active_params': step_flops['active_params'],
      }
  return split, f'{head} does not reproduce these rungs: {"; ".join(why)}.' if why else None


def report_from_json(
  path: str | pathlib.Path,
  workdir: str | pathlib.Path,
  *,
  publish: str | None = None,
  ladder_file: str = 'configs/ladder.py',
) -> dict:
  """Rewrites the report from a ladder.json alone (a published one, say, whose run folders are
  gone): its rungs' rows, fitted again. The report keeps the json's date and hardware, and the
  command of the call that wrote it ('ladder_command'). A ladder.json from before the
  model/optimizer split holds only C = model + optimizer FLOPs ('flops'): split_from_plan counts
  the split again from ladder_file where that reproduces a rung's recorded C exactly; a rung where
  it does not shows '-' for it (the report says why) and is left out of the model FLOPs fits."""
  started = time.time()
  data = json.loads(pathlib.Path(path).read_text())
  ladder = ml_collections.ConfigDict(
    {
      'name': data['ladder'],
      'rule': data['rule'],
      'tokens_per_param': data['tokens_per_param'],
      'baseline': data['baseline'],
      'variants': {v: [tuple(kv) for kv in o] for v, o in data['variants'].items()},
    }
  )
  split, note = split_from_plan(data, ladder_file)
  rows = [
    {
      'model_flops': None,
      'optimizer_flops': None,
      'active_params': r['params'],
      'hardware': None,
      **r,
      **split.get((r['variant'], r['rung']), {}),
    }
    for r in data['rungs']
  ]
  prov = runs_lib.provenance()
  prov.update({k: data[k] for k in ('date', 'hardware') if data.get(k)})
  if data.get('ladder_command') or data.get('command'):
    prov['ladder_command'] = data.get('ladder_command') or data['command']
  return write_report(
    ladder,
    rows,
    data['planned_rungs'],
    pathlib.Path(workdir),
    publish,
    started,
    prov=prov,
    notes=[note] if note else [],
  )


def define_flags():
  from absl import flags

  from kimijax.config import define_config_flag

  define_config_flag(
    'config',
    None,
    'the ladder, configs/ladder.py:NAME (--config.base.a.b=v overrides a key of every rung); '
    'required but with --from_json',
  )
  flags.DEFINE_string('workdir', None, 'output folder: <variant>/<rung>/ runs, ladder.json, ladder.md, ladder.png')
  flags.DEFINE_list('variants', [], 'variants to run (default: all); the report covers every finished one')
  flags.DEFINE_float('time_budget_s', None, 'start no rung that would end past this many seconds')
  flags.DEFINE_string('publish', None, 'also copy the report to PREFIX.md/.png/.json')
  flags.DEFINE_bool('report_only', False, 'train nothing: rewrite the report from the rungs finished in --workdir')
  flags.DEFINE_bool(
    'drop_finished_checkpoints',
    False,
    "remove a rung's checkpoints once it is finished "
    '(its figures stay), so that the workdir is small enough to carry between machines',
  )
  flags.DEFINE_string(
    'from_json',
    None,
    'train nothing and read no run folder: rewrite the report from this ladder.json alone (e.g. a '
    'published one; --config is then not needed)',
  )
  flags.mark_flags_as_required(['workdir'])


def main(argv):
  del argv
  from absl import flags

  from experiments.cli import user_errors
  from kimijax.config import config_from_flags

  with user_errors():
    f = flags.FLAGS
    if f.from_json:
      report_from_json(f.from_json, f.workdir, publish=f.publish)
      return
    run_ladder(
      config_from_flags('config', validate=False),
      f.workdir,
      variants=f.variants or None,
      time_budget_s=f.time_budget_s,
      publish=f.publish,
      drop_checkpoints=f.drop_finished_checkpoints,
      report_only=f.report_only,
    )


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
