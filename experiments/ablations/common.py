"""What every ablation file shares: arms run through the sweep machinery, the published table beside
ours, and one fixed verdict rule per published ordering.

An ablation file defines `base(scale)` (a kimijax config; scale 'cpu' or 'gpu'), its ARMS
(name, overrides, the published figure), its CLAIMS (published orderings between arms) and calls
`main(...)`. `python -m experiments.ablations.<file> --scale=gpu --workdir=DIR --seeds=2` trains
every arm (resuming and reusing runs like experiments/sweep.py), then writes DIR/ablation.md
(and, with --publish, experiments/results/ablation_<file>.md/.png/.json). --config.KEY=VALUE
overrides a key of the base config for every arm (e.g. --config.train.steps=20), except the keys
the arms themselves set.

The verdict (`verdict`) is decided before any run and never tuned: with >= 2 seeds per arm a gap
within NOISE_Z standard errors of the difference of the means is "inside seed noise"; otherwise
the sign decides "reproduces" or "refuted". With one seed the noise is not measured and the
verdict says so. A claim that two arms coincide ('=') reproduces when the gap is inside the noise.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics
import sys
from collections.abc import Callable

NOISE_Z = 2.0  # fixed before any run: gaps within 2 standard errors are seed noise


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  overrides: dict
  published: str = ''  # the paper's figure for this arm, as printed there
  runnable: bool = True  # False: the paper's arm needs a switch kimijax does not have


@dataclasses.dataclass(frozen=True)
class Claim:
  """The paper's ordering: `a` relation `b` on `metric` ('<': a lower, '>': a higher, '=': equal)."""

  a: str
  relation: str
  b: str
  metric: str = 'final_eval_loss'
  source: str = ''


def verdict(a: list[float], b: list[float], relation: str) -> str:
  """'reproduces' | 'refuted' | 'inside seed noise', from per-seed values of the two arms."""
  if relation not in ('<', '>', '='):
    raise ValueError(f"relation must be '<', '>' or '='; got {relation!r}")
  gap = statistics.fmean(a) - statistics.fmean(b)
  if gap == 0 and relation != '=':  # e.g. both arms recall everything: no ordering to judge
    return 'tie (equal means)'
  if len(a) < 2 or len(b) < 2:
    if relation == '=':
      return 'no verdict (1 seed: equality needs the seed noise)'
    holds = gap < 0 if relation == '<' else gap > 0
    return ('reproduces' if holds else 'refuted') + ' (1 seed: noise not measured)'
  se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
  inside = abs(gap) <= NOISE_Z * se
  if relation == '=':
    return 'reproduces (inside seed noise)' if inside else 'refuted'
  if inside:
    return 'inside seed noise'
  return 'reproduces' if (gap < 0 if relation == '<' else gap > 0) else 'refuted'


LATE_FRACTION = 0.2  # 'moe_load_max_mean_late' averages the logged steps of the run's last fifth


def late_mean(curve: list, steps: int) -> float:
  """Mean of a curve's [(step, value)] at the steps past (1 - LATE_FRACTION) * steps: a figure for
  the end of a run from several logged steps rather than one batch."""
  values = [v for s, v in curve if s > (1 - LATE_FRACTION) * steps]
  if not values:
    raise ValueError(f'no logged step past {(1 - LATE_FRACTION) * steps:g} of {steps} in the curve')
  return statistics.fmean(values)


def metric_values(point: dict, metric: str) -> list[float]:
  """Per-seed values of `metric` for one arm of sweep.json; 'long_context_loss' is the eval loss of
  the last position bucket (the longest contexts); 'moe_load_max_mean_late' is the logged
  moe_load_max_mean (the most loaded expert's load over the mean load, in the MoE layer where that
  is largest, per training batch; 1 is balanced) averaged over the run's last fifth of steps."""
  out = []
  for run in point['runs']:
    if metric == 'long_context_loss':
      out.append(run['loss_by_position']['loss'][-1])
    elif metric == 'moe_load_max_mean_late':
      curve = run['curves'].get('moe_load_max_mean')
      if not curve:
        raise ValueError(f'{run["run_dir"]}: no moe_load_max_mean logged (not a MoE model?)')
      out.append(late_mean(curve, run['steps']))
    else:
      out.append(run[metric])
  return out


def report(title: str, arms: list[Arm], claims: list[Claim], data: dict, commands: str, png: str) -> str:
  """Markdown: ours beside the published figure per arm, then each claim with its verdict."""
  from experiments.runs import fmt_mean

  points = {p['label']: p for p in data['points']}
  lines = [
    f'# {title}',
    '',
    f'Date: {data["date"]}. Hardware: {data["hardware"]}.',
    '',
    'Command:',
    '',
    f'    {data["command"]}',
    '',
    "The file's commands:",
    '',
    commands.strip('\n'),
    '',
    '| arm | seeds | final eval loss (ours) | accuracy (ours) | published |',
    '|---|---|---|---|---|',
  ]
  for arm in arms:
    if arm.name not in points:
      why = 'not run' if arm.runnable else 'not runnable in kimijax'
      lines.append(f'| {arm.name} | 0 | {why} | - | {arm.published} |')
      continue
    p = points[arm.name]
    lines.append(
      f'| {arm.name} | {len(p["runs"])} | {fmt_mean(metric_values(p, "final_eval_loss"))} | '
      f'{fmt_mean(metric_values(p, "final_accuracy"), 3)} | {arm.published} |'
    )
  lines += [
    '',
    f'Verdicts (fixed rule: with >= 2 seeds a gap within {NOISE_Z:g} standard errors is seed noise):',
    '',
    '| published ordering | metric | ours (mean over seeds) | verdict | source |',
    '|---|---|---|---|---|',
  ]
  for c in claims:
    if c.a not in points or c.b not in points:
      lines.append(f'| {c.a} {c.relation} {c.b} | {c.metric} | not run | - | {c.source} |')
      continue
    va, vb = metric_values(points[c.a], c.metric), metric_values(points[c.b], c.metric)
    lines.append(
      f'| {c.a} {c.relation} {c.b} | {c.metric} | {statistics.fmean(va):.4f} vs '
      f'{statistics.fmean(vb):.4f} | **{verdict(va, vb, c.relation)}** | {c.source} |'
    )
  lines += [
    '',
    f'![curves]({png})',
    '',
    'Losses in nats per byte on our corpus, so only orderings are compared with the paper, '
    "never values. Runs, curves and the sweep table: the workdir's sweep.md.",
  ]
  return '\n'.join(lines) + '\n'


def sized(
  config,
  scale: str,
  *,
  d_model: int,
  num_layers: int,
  num_heads: int,
  seq_len: int,
  batch_size: int,
  steps: int,
  **overrides,
):
  """config at an ablation's size: width, depth, heads, SwiGLU 3 d, tokens per step, steps (evals
  and checkpoints every steps / 5, warmup 5%). scale 'gpu' adds kimijax/configs_common.py's GPU
  kernels (bf16, tokamax attention, the Pallas KDA and short conv, the 'mosaic' grouped matmul)
  and GPU data (the site-packages corpus, 16 eval batches). Keys in `overrides` are written with
  '__' for '.' (model__attn_impl='xla')."""
  from experiments.runs import with_overrides
  from kimijax import configs_common

  every = max(steps // 5, 1)
  config = with_overrides(
    config,
    {
      'model.d_model': d_model,
      'model.num_layers': num_layers,
      'model.num_heads': num_heads,
      'model.mlp_dim': 3 * d_model,
      'train.seq_len': seq_len,
      'train.batch_size': batch_size,
      'train.steps': steps,
      'train.eval_every': every,
      'train.checkpoint_every': every,
      'optimizer.warmup_steps': max(steps // 20, 1),
    },
  )
  if scale == 'gpu':
    configs_common.gpu_kernels(config.model, attn_impl='tokamax')
    configs_common.gpu_data(config)
  return with_overrides(config, {k.replace('__', '.'): v for k, v in overrides.items()})


def define_flags(default_workdir: str):
  from absl import flags

  flags.DEFINE_enum(
    'scale',
    'cpu',
    ['cpu', 'gpu'],
    "'cpu': tiny models that show the workflow on a "
    "2-core CPU (orderings there mean little); 'gpu': the sizes for one H200",
  )
  flags.DEFINE_string('workdir', default_workdir, 'output folder: runs/, sweep.md, ablation.md')
  flags.DEFINE_integer('seeds', 2, 'runs per arm')
  flags.DEFINE_list('arms', [], 'arms to run (default: all); unknown names are an error')
  flags.DEFINE_string(
    'publish', None, 'also copy the report to PREFIX.md/.png/.json (e.g. experiments/results/ablation_NAME)'
  )
  from experiments.cli import list_in_help
  from kimijax.config import define_override_flags

  list_in_help('scale', 'workdir', 'seeds', 'arms', 'publish')
  # --config.KEY=VALUE overrides a key of the ablation's base config (every arm), as in run.py
  define_override_flags('config')


def with_command_line_overrides(config, overrides: dict[str, str], arms: list[Arm]):
  """config with the --config.KEY=VALUE overrides (strings parsed as each key's type), validated;
  WorkflowError for a key that an arm sets (the arms are the experiment)."""
  from experiments.runs import WorkflowError
  from kimijax.config import override, validate

  for key in overrides:
    setters = [a.name for a in arms if key in a.overrides]
    if setters:
      raise WorkflowError(
        f'--config.{key}: the arms {setters} set {key} (what this ablation compares); it stays theirs'
      )
  config = config.copy_and_resolve_references()
  for key, value in overrides.items():
    override(config, key, value)
  return validate(config)


def main(
  title: str, base: Callable[[str], object], arms: list[Arm], claims: list[Claim], commands: str, *, devices=None
) -> dict:
  """Runs the chosen arms (flags from define_flags) and writes the ablation report."""
  from absl import flags

  from experiments import runs as runs_lib
  from experiments.cli import user_errors

  FLAGS = flags.FLAGS
  with user_errors():
    known = [a.name for a in arms if a.runnable]
    for name in FLAGS.arms:
      if name not in known:
        raise runs_lib.WorkflowError(f'--arms: unknown or not runnable arm {name!r}; allowed: {known}')
    chosen = [a for a in arms if a.runnable and (not FLAGS.arms or a.name in FLAGS.arms)]
    from kimijax.config import overrides_from_flags

    return run(
      title,
      with_command_line_overrides(base(FLAGS.scale), overrides_from_flags('config'), chosen),
      chosen,
      arms,
      claims,
      commands,
      seeds=FLAGS.seeds,
      workdir=FLAGS.workdir,
      publish=FLAGS.publish,
      devices=devices,
    )


def run(
  title,
  config,
  chosen: list[Arm],
  arms: list[Arm],
  claims: list[Claim],
  commands: str,
  *,
  seeds: int,
  workdir,
  publish=None,
  devices=None,
) -> dict:
  from experiments import runs as runs_lib, sweep

  if any(c.metric == 'moe_load_max_mean_late' for c in claims):  # checked before any arm trains
    for arm in chosen:
      kind = arm.overrides.get('model.mlp_kind', config.model.mlp_kind)
      if kind != 'moe':
        raise runs_lib.WorkflowError(
          f'arm {arm.name!r} has model.mlp_kind={kind!r}: the claims on moe_load_max_mean_late need '
          'MoE layers to read the expert loads from'
        )
  workdir = pathlib.Path(workdir)
  runs_lib.check_outputs(workdir, publish)
  data = sweep.run_points(
    config,
    [(a.name, a.overrides) for a in chosen],
    seeds=seeds,
    workdir=workdir,
    title=title,
    devices=devices,
    description=f'{len(chosen)} arms',
  )
  md = workdir / 'ablation.md'
  md.write_text(report(title, arms, claims, data, commands, 'loss_curves.png'))
  print(md.read_text())
  if publish:
    files = {'.md': md, '.png': workdir / 'loss_curves.png', '.json': workdir / 'sweep.json'}
    for path in runs_lib.publish(files, publish):
      print(f'published {path}')
  return data


def script(title: str, base: Callable[[str], object], arms, claims, doc: str, workdir: str) -> None:
  """An ablation file's `if __name__ == '__main__'`: its flags, then main. `arms` and `claims` are
  lists, or functions of the scale (for grids that change with it); `doc` is the file's docstring
  (its second paragraph goes into the report)."""
  from absl import app, flags

  define_flags(workdir)
  main_module = sys.modules['__main__']
  main_module.__doc__ = (main_module.__doc__ or '') + (
    '\nEvery ablation also takes --config.KEY=VALUE, overriding a key of its base config for every\n'
    'arm (e.g. --config.train.steps=20), except the keys the arms set.\n'
  )

  def run_main(argv):
    del argv
    scale = flags.FLAGS.scale
    main(
      title,
      base,
      arms(scale) if callable(arms) else arms,
      claims(scale) if callable(claims) else claims,
      doc.split('\n\n')[1],
    )

  app.run(run_main)
