"""Train the cross product of config values, with seeds, and report it.

    python -m experiments.sweep --config=configs/default.py[:arg] --workdir=DIR \\
        --sweep=optimizer.name=adamw,muon [--sweep=optimizer.learning_rate=1e-3,3e-3] [--seeds=2] \\
        [--config.train.steps=200 ...] [--publish=experiments/results/NAME]

Every point of the cross product of the --sweep axes, once per seed (config.seed, config.seed + 1,
...), trains through kimijax.train.loop.train (the path of run.py) in DIR/runs/<point>,seed=<s>/.
Re-running the same command resumes half-finished runs from their checkpoints and reuses finished
ones, so a sweep can be finished over several calls; a run folder holding another config stops
the sweep with the keys that differ (nothing is deleted). Then it writes

  DIR/sweep.json         every run's figures and curves, the axes, the date, hardware and command
  DIR/sweep.md           one row per point: final train loss (the last logged step) and final eval
                         loss (the eval at the last step), as mean ± sample std over seeds, eval
                         accuracy (MQAR: recall accuracy, the fraction of queried values recalled
                         exactly), tokens, training FLOPs (kimijax.train.flops), median tokens/s,
                         max logit (final / peak), wall time
  DIR/loss_curves.png    train loss against step, eval loss against training FLOPs, max logit
                         against step, for MoE models the worst layer's max / mean expert load
                         against step, and the final eval loss by token position (log axis: does
                         the model keep improving with context?); one colour per point, one line
                         per seed

and, with --publish=PREFIX, copies them to PREFIX.md / PREFIX.png / PREFIX.json (e.g. under
experiments/results/). Without --publish nothing outside DIR is written. Expected output of
`--config=configs/default.py --sweep=optimizer.name=adamw,muon --config.train.steps=50
--config.train.eval_every=50` on the 2-core CPU: two runs of ~40 s and a two-row table (eval loss
about 2.9 / 2.6).
"""

from __future__ import annotations

import itertools
import pathlib
import re

import ml_collections

from experiments import runs as runs_lib
from experiments.runs import WorkflowError


def parse_value(key: str, text: str, current):
  """One --sweep value, typed like the config's current value at key, as a --config.a.b=v override
  is (an int key takes 1e3)."""
  from kimijax.config import ConfigError
  from kimijax.schema import parse_value

  try:
    return parse_value(key, text, current)
  except ConfigError:
    raise WorkflowError(
      f'--sweep {key}={text!r}: {key} is of type {type(current).__name__} ({current!r}); {text!r} is not one'
    ) from None


def get_key(config: ml_collections.ConfigDict, key: str):
  node = config
  for part in key.split('.'):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise WorkflowError(f'--sweep: unknown config key {key!r}')
    node = node[part]
  if isinstance(node, ml_collections.ConfigDict):
    raise WorkflowError(f'--sweep: {key!r} is a group, not a value')
  return node


def parse_axes(specs: list[str], config: ml_collections.ConfigDict) -> list[tuple[str, list]]:
  """['a.b=1,2', ...] -> [('a.b', [1, 2]), ...], typed and checked against config."""
  axes = []
  for spec in specs:
    key, sep, values = spec.partition('=')
    if not sep or not key or not values:
      raise WorkflowError(f'--sweep={spec!r}: expected KEY=V1,V2,... (e.g. optimizer.name=adamw,muon)')
    if key in [k for k, _ in axes]:
      raise WorkflowError(f'--sweep: {key!r} is given twice')
    if key == 'seed':
      raise WorkflowError('--sweep: use --seeds=N for seeds')
    current = get_key(config, key)
    axes.append((key, [parse_value(key, v.strip(), current) for v in values.split(',')]))
  return axes


def points(axes: list[tuple[str, list]]) -> list[dict]:
  """The cross product: one {key: value} per point, the first axis varying slowest."""
  keys = [k for k, _ in axes]
  return [dict(zip(keys, combo)) for combo in itertools.product(*[v for _, v in axes])]


def point_label(point: dict) -> str:
  """'name=muon,learning_rate=0.003' (last key parts, full keys where those collide)."""
  short = [k.split('.')[-1] for k in point]
  names = [s if short.count(s) == 1 else k for s, k in zip(short, point)]
  return ','.join(f'{n}={v}' for n, v in zip(names, point.values())) or 'base'


def run_config(config, point: dict, seed: int) -> ml_collections.ConfigDict:
  c = runs_lib.with_overrides(config, {**point, 'seed': seed})
  from kimijax.config import validate

  return validate(c)


def plan(config, named_points: list[tuple[str, dict]], seeds: int, workdir: pathlib.Path) -> list[dict]:
  """[{label, point, seed, config, run_dir}] for every (label, overrides) point and seed, every
  config validated and every run folder checked before any training."""
  if seeds < 1:
    raise WorkflowError(f'--seeds={seeds} must be >= 1')
  labels = [label for label, _ in named_points]
  if len(set(labels)) != len(labels):
    raise WorkflowError(f'point names must differ; got {labels}')
  out = []
  for label, point in named_points:
    for seed in range(config.seed, config.seed + seeds):
      c = run_config(config, point, seed)
      run_dir = workdir / 'runs' / (re.sub(r'[^\w.=,:+-]', '_', label) + f',seed={seed}')  # a safe folder name
      runs_lib.check_folder(run_dir, c)
      out.append({'label': label, 'point': point, 'seed': seed, 'config': c, 'run_dir': run_dir})
  return out


def named(axes) -> list[tuple[str, dict]]:
  return [(point_label(p), p) for p in points(axes)]


def aggregate(results: list[dict]) -> list[dict]:
  """One row per point (in plan order) with the list of its runs."""
  rows = {}
  for r in results:
    rows.setdefault(r['label'], {'label': r['label'], 'point': r['point'], 'runs': []})['runs'].append(r)
  return list(rows.values())


def _fmt_int(x) -> str:
  return '-' if x is None else f'{x:,.0f}'


def markdown(swept: str, rows: list[dict], prov: dict, png_name: str, title: str) -> str:
  seeds = max(len(r['runs']) for r in rows)
  accuracy_name = (
    'recall accuracy' if rows[0]['runs'][0]['figures']['accuracy_key'] == 'eval_recall_accuracy' else 'eval accuracy'
  )
  lines = [
    f'# {title}',
    '',
    f'Date: {prov["date"]}. Hardware: {prov["hardware"]}.',
    '',
    'Command:',
    '',
    f'    {prov["command"]}',
    '',
    f'{swept}; {seeds} seed(s) per point. Losses in nats per token; mean ± sample standard deviation over seeds.',
    '',
    f'| point | seeds | final train loss | final eval loss | {accuracy_name} | tokens | training FLOPs | '
    'tokens/s | max logit (final / peak) | wall s |',
    '|---|---|---|---|---|---|---|---|---|---|',
  ]
  for row in rows:
    figs = [r['figures'] for r in row['runs']]
    peak = [f['max_logit_peak'] for f in figs if f['max_logit_peak'] is not None]
    final = [f['max_logit_final'] for f in figs if f['max_logit_final'] is not None]
    logit = f'{runs_lib.fmt_mean(final, 2)} / {max(peak):.2f}' if peak else '-'
    rates = [f['tokens_per_sec'] for f in figs if f['tokens_per_sec']]
    walls = [f['wall_seconds'] for f in figs if f['wall_seconds']]
    lines.append(
      f'| {row["label"]} | {len(figs)} | {runs_lib.fmt_mean([f["final_train_loss"] for f in figs])} | '
      f'{runs_lib.fmt_mean([f["final_eval_loss"] for f in figs])} | '
      f'{runs_lib.fmt_mean([f["final_accuracy"] for f in figs], 3)} | {_fmt_int(figs[0]["tokens"])} | '
      f'{figs[0]["flops"]:.3g} | {_fmt_int(sum(rates) / len(rates) if rates else None)} | {logit} | '
      f'{_fmt_int(sum(walls) / len(walls) if walls else None)} |'
    )
  lines += [
    '',
    f'![loss curves]({png_name})',
    '',
    'Final train loss is the loss logged at the last step; final eval loss is the eval at the '
    'last step on the fixed validation batches. Training FLOPs: kimijax.train.flops (6 N + '
    'causal attention + KDA state products per token, plus Newton-Schulz for Muon). tokens/s is '
    'the median logged rate (the first step, which compiles, excluded); wall time includes '
    'compilation and evals.',
  ]
  return '\n'.join(lines) + '\n'


def plot(rows: list[dict], out: pathlib.Path, title: str) -> pathlib.Path:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  has_logits = any(r['figures']['curves']['max_logit'] for row in rows for r in row['runs'])
  # MoE runs: the worst layer's max / mean expert load against step (absent from older sweep.json)
  has_loads = any(r['figures']['curves'].get('moe_load_max_mean') for row in rows for r in row['runs'])
  panels = 3 + has_logits + has_loads
  load_ax = 2 + has_logits
  fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.5))
  for i, row in enumerate(rows):
    color = f'C{i % 10}'
    for j, r in enumerate(row['runs']):
      curves, label = r['figures']['curves'], row['label'] if j == 0 else None
      step_flops = r['figures']['flops_per_step']['total']
      axes[0].plot(*zip(*curves['train']), color=color, alpha=0.5, lw=1, label=label)
      es, el = zip(*curves['eval'])
      axes[1].plot([s * step_flops for s in es], el, 'o-', color=color, ms=4, lw=1.5, label=label)
      if has_logits and curves['max_logit']:
        axes[2].plot(*zip(*curves['max_logit']), color=color, lw=1.2, label=label)
      if has_loads and curves.get('moe_load_max_mean'):
        axes[load_ax].plot(*zip(*curves['moe_load_max_mean']), color=color, lw=1.2, label=label)
      by_position = r['figures']['loss_by_position']
      points = [
        (last + 1, loss)
        for (_, last), loss in zip(by_position['buckets'] or [], by_position['loss'] or [])
        if loss is not None
      ]
      if points:
        axes[-1].plot(*zip(*points), 'o-', ms=3, color=color, lw=1.2, alpha=0.8, label=label)
  axes[0].set(xlabel='step', ylabel='train loss (nats/token)')
  axes[1].set(xlabel='training FLOPs', ylabel='eval loss (nats/token)', xscale='log')
  if has_logits:
    axes[2].set(xlabel='step', ylabel='max logit (all layers, heads)', yscale='log')
  if has_loads:
    axes[load_ax].set(xlabel='step', ylabel='MoE load max / mean (worst layer)', yscale='log')
  axes[-1].set(xlabel='token position (context seen, bucket end)', ylabel='final eval loss by position', xscale='log')
  for ax in axes:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title)
  fig.savefig(out, dpi=110, bbox_inches='tight')
  plt.close(fig)
  return out


def run_sweep(
  config: ml_collections.ConfigDict,
  axes: list[tuple[str, list]],
  *,
  seeds: int,
  workdir: str | pathlib.Path,
  publish: str | None = None,
  title: str = 'Sweep',
  devices=None,
) -> dict:
  """Trains (or resumes, or reuses) every run of the cross product of `axes`, then writes the
  report into workdir (and to the --publish prefix). Returns the report's data (as in sweep.json)."""
  swept = 'Swept: ' + '; '.join(f'`{k}` in {v}' for k, v in axes)
  return run_points(
    config,
    named(axes),
    seeds=seeds,
    workdir=workdir,
    publish=publish,
    title=title,
    devices=devices,
    description=swept,
    extra={'axes': axes},
  )


def run_points(
  config: ml_collections.ConfigDict,
  named_points: list[tuple[str, dict]],
  *,
  seeds: int,
  workdir: str | pathlib.Path,
  publish: str | None = None,
  title: str = 'Sweep',
  devices=None,
  description: str = '',
  extra: dict | None = None,
) -> dict:
  """run_sweep for an explicit list of (label, overrides) points (the ablations' arms)."""
  workdir = pathlib.Path(workdir)
  runs_lib.check_outputs(workdir, publish)
  runs = plan(config, named_points, seeds, workdir)
  results = []
  for k, run in enumerate(runs):
    print(f'sweep: run {k + 1} of {len(runs)}: {run["run_dir"].name}', flush=True)
    results.append({**run, 'figures': runs_lib.train_run(run['config'], run['run_dir'], devices=devices)})
  rows = aggregate(results)
  prov = runs_lib.provenance()
  workdir.mkdir(parents=True, exist_ok=True)
  png = plot(rows, workdir / 'loss_curves.png', title)
  md = workdir / 'sweep.md'
  md.write_text(markdown(description or f'{len(rows)} points', rows, prov, png.name, title))
  data = {
    'title': title,
    **prov,
    **(extra or {}),
    'seeds': seeds,
    'points': [
      {'point': row['point'], 'label': row['label'], 'runs': [{'seed': r['seed'], **r['figures']} for r in row['runs']]}
      for row in rows
    ],
  }
  js = workdir / 'sweep.json'
  js.write_text(runs_lib.to_json(data))
  print(md.read_text())
  print(f'wrote {md}, {png}, {js}')
  if publish:
    for path in runs_lib.publish({'.md': md, '.png': png, '.json': js}, publish):
      print(f'published {path}')
  return data


def define_flags():
  from absl import flags

  from kimijax.config import define_config_flag

  define_config_flag('config', None, 'base config file, FILE[:VARIANT[,VARIANT]].')
  flags.DEFINE_multi_string('sweep', [], 'KEY=V1,V2,...: one axis of the cross product (repeatable)')
  flags.DEFINE_integer('seeds', 1, 'runs per point, seeds config.seed, config.seed + 1, ...')
  flags.DEFINE_string('workdir', None, 'output folder: runs/, sweep.json, sweep.md, loss_curves.png')
  flags.DEFINE_string('publish', None, 'also copy the report to PREFIX.md/.png/.json (e.g. experiments/results/NAME)')
  flags.DEFINE_string('title', 'Sweep', 'report title')
  flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  from absl import flags

  from experiments.cli import user_errors
  from kimijax.config import config_from_flags

  FLAGS = flags.FLAGS
  with user_errors():
    if not FLAGS.sweep:
      raise WorkflowError('give at least one --sweep=KEY=V1,V2,... (or use run.py for a single run)')
    config = config_from_flags('config')
    run_sweep(
      config,
      parse_axes(FLAGS.sweep, config),
      seeds=FLAGS.seeds,
      workdir=FLAGS.workdir,
      publish=FLAGS.publish,
      title=FLAGS.title,
    )


if __name__ == '__main__':
  from absl import app

  define_flags()
  app.run(main)
