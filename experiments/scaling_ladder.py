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
alone (no run folders; no flag that plans or trains rungs), keeping its date and hardware; for a ladder.json from
before the model / optimizer split it counts the split again from configs/ladder.py where that
count reproduces each rung's recorded FLOPs exactly, and says which rungs it cannot.

Training FLOPs per rung come from kimijax.train.flops (the count bench_train's MFU uses): model
FLOPs (6 N_active + attention + KDA state products per token) and optimizer FLOPs (Muon's
Newton-Schulz per step, on every expert's matrices, active or not). C, in PFLOP/s-days, is counted
both ways, as model FLOPs (the count of the Moonlight, Kimi Linear and Attention Residuals
reports, and the one the verdict reads) and as model + optimizer FLOPs. The report
(experiments/ladder_report.py, which also rebuilds it for --from_json) fits, per count and variant,
L = A C^-alpha (log-log least squares) and, with >= 4 rungs, L = E + A C^-alpha
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

import math
import pathlib
import time

import ml_collections

from experiments import ladder_report, runs as runs_lib
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
  if time_budget_s is not None and time_budget_s < 0:
    raise WorkflowError(f'--time_budget_s={time_budget_s} must be >= 0 (0: one rung; leave it out for no budget)')
  runs_lib.check_outputs(workdir, publish)
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
  return ladder_report.write_report(ladder, rows, len(planned), workdir, publish, started)


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
    'published one; no flag that plans or trains rungs goes with it)',
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
      ignored = [
        n for n in ('config', 'variants', 'report_only', 'time_budget_s', 'drop_finished_checkpoints') if f[n].present
      ]
      if ignored:
        raise WorkflowError(
          f'--from_json rewrites the report of a ladder.json alone; it takes no --{", --".join(ignored)}'
        )
      ladder_report.report_from_json(f.from_json, f.workdir, publish=f.publish)
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
