"""The report of a scaling ladder, and its rebuilding from a ladder.json alone.

experiments/scaling_ladder.py plans and trains the rungs and hands their rows to write_report;
its --from_json calls report_from_json. This module holds what turns rows into the report: the
fits per count of C and variant and the compute multipliers against the baseline (analyse,
fits_for, verdict_reading; the maths is experiments/ladder_fit.py), the markdown tables and the
verdict's lines (markdown), the loss-against-compute figure (plot), and write_report, which writes
DIR/ladder.json / .md / .png. report_from_json rebuilds the rows from a ladder.json, with
split_from_plan counting the model / optimizer split again from the ladder's plan where the json
lacks it. The counts of C: docs/scaling_ladders.md#compute.
"""

from __future__ import annotations

import json
import pathlib
import time

import ml_collections

from experiments import ladder_fit, runs as runs_lib
from experiments.runs import WorkflowError

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
  """'model FLOPs | optimizer FLOPs (share of model + optimizer) | C model / total (PF-days)', '-'
  where not held."""
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
  # Variants with a multiplier on model + optimizer FLOPs alone (rungs without the split) get none.
  unread = [v for v in analysis['multipliers']['total'] if v not in analysis['verdict']]
  if not analysis['verdict'] or unread:
    who = ', '.join(f'`{v}`' for v in unread) + ': ' if unread and analysis['verdict'] else ''
    lines.append(
      f'- {who}no reading: needs >= 2 finished rungs of the baseline and of a variant, each with its model '
      'FLOPs (a ladder.json from before the model/optimizer split has only their sum)'
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
  # Every variant with a multiplier on any shown count: where some rungs lack the split, a variant
  # may have one on model + optimizer FLOPs alone.
  with_multiplier = [v for v in analysis['fits'][shown[0]] if any(v in analysis['multipliers'][c] for c in shown)]
  for v in with_multiplier:
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
  if not with_multiplier:
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
  from experiments.scaling_ladder import planned_rungs  # here: scaling_ladder imports this module
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


# What report_from_json reads of a ladder.json: its keys, and each rung's (those of a ladder.json from
# before the model/optimizer split too).
JSON_KEYS = ('ladder', 'rule', 'tokens_per_param', 'baseline', 'variants', 'rungs', 'planned_rungs')
RUNG_KEYS = (
  'variant rung d_model num_layers num_heads batch_size learning_rate params tokens steps flops '
  'final_eval_loss final_train_loss epochs tokens_per_sec wall_seconds'
).split()


def read_ladder_json(path: str | pathlib.Path) -> dict:
  """A ladder.json's data; a WorkflowError naming --from_json and the path where it cannot be read,
  is not JSON, or lacks a key the report needs."""
  where = f'--from_json={path}'
  try:
    data = json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError) as e:
    raise WorkflowError(f'{where}: cannot read it as JSON ({e})') from None
  missing = [k for k in JSON_KEYS if k not in data] if isinstance(data, dict) else list(JSON_KEYS)
  if missing:
    raise WorkflowError(f'{where}: not a ladder.json of experiments/scaling_ladder.py (it lacks {missing})')
  for i, rung in enumerate(data['rungs']):
    lacking = [k for k in RUNG_KEYS if k not in rung] if isinstance(rung, dict) else RUNG_KEYS
    if lacking:
      raise WorkflowError(f'{where}: its rung {i} lacks {lacking}')
  return data


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
  data = read_ladder_json(path)
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
