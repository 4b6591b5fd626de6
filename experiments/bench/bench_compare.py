"""Step-time overhead of one training setup over another, from alternating runs on one device.

    python -m experiments.bench.bench_compare --base='--config=configs/bench_350m.py' \
        --other='--config=configs/bench_350m.py:attnres_block' [--rounds=3] [--steps=20]
    # a step-level tile sweep: --other='--config=...:attnres_block --phase1_tiles=dc_grads=64'

--base and --other are each an argument string for experiments/bench/bench_train.py. They run in
fresh processes on this process's devices (CUDA_VISIBLE_DEVICES), `rounds` times each, in the
order base, other, other, base, base, other, ... so that a slow drift of the device's speed
falls on both alike. All runs share one persistent XLA compilation cache (--cache_dir), so only
the first run of each setup compiles (on an H200 about 2 minutes for bench_350m; later runs
take about 30 s). Prints a Markdown table of the runs (run, setup, step ms, peak GiB, loss) and the
overhead of the medians, e.g. "other over base: **+5.0%**" for the command above on one H200.
--time_budget_s=S starts no run that would end past S seconds, judged by the last run of its
setup, and reports the runs done: inside a time-limited call, a cut-short comparison still
gives its table and JSON.

Why one device: two H200s of one host differed by 1.3% in step time for the same program
(experiments/results/bench_attnres.md, 2026-11-30), more than the effects being measured, so
pairs that run one setup per GPU side by side mislead. To use two GPUs, run two instances,
one per GPU, and read each table on its own.
"""

import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from experiments import runs as runs_lib
from experiments.cli import usage_error

ROOT = pathlib.Path(__file__).resolve().parents[2]

FLAGS = flags.FLAGS


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module
  next to others that define flags of the same names)."""
  flags.DEFINE_string('base', None, 'bench_train.py arguments of the reference setup')
  flags.DEFINE_string('other', None, 'bench_train.py arguments of the setup measured against it')
  flags.DEFINE_integer('rounds', 3, 'runs of each setup')
  flags.DEFINE_integer('steps', 20, 'timed steps per run')
  flags.DEFINE_integer('warmup', 3, 'untimed steps per run (the first run of a setup also compiles)')
  flags.DEFINE_string('cache_dir', str(ROOT / 'runs/xla_cache'), 'persistent XLA compilation cache')
  flags.DEFINE_string('json_out', None, 'also write the runs and the summary to this JSON file')
  flags.DEFINE_float(
    'time_budget_s',
    None,
    'start no run that would end past this many seconds, '
    'judged by the last run of its setup (the first run of each setup always '
    'runs); the report then covers the runs done',
  )
  flags.mark_flags_as_required(['base', 'other'])


def run_order(rounds: int) -> list[str]:
  """base, other, other, base, ...: each setup `rounds` times, alternating which goes first."""
  order = []
  for r in range(rounds):
    order += ['base', 'other'] if r % 2 == 0 else ['other', 'base']
  return order


def fits_budget(elapsed_s: float, last_s: float | None, budget_s: float | None) -> bool:
  """Whether to start a run: always without a budget or a previous run of its setup to judge
  by (so each setup runs at least once), else if one more such run ends within the budget."""
  return budget_s is None or last_s is None or elapsed_s + last_s <= budget_s


def bench_once(args: str, out: pathlib.Path, *, steps: int, warmup: int, cache_dir: str) -> dict:
  """One experiments/bench/bench_train.py process; its JSON figures. A failed run is a RuntimeError
  that shows the end of its output."""
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  cmd = [
    sys.executable,
    '-m',
    'experiments.bench.bench_train',
    f'--steps={steps}',
    f'--warmup={warmup}',
    f'--json_out={out}',
    *shlex.split(args),
  ]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if proc.returncode != 0:
    tail = '\n'.join((proc.stdout + proc.stderr).splitlines()[-15:])
    raise RuntimeError(f'bench_compare: this run failed (exit {proc.returncode}):\n  {shlex.join(cmd)}\n{tail}')
  return json.loads(out.read_text())


def header(results: list[dict]) -> dict:
  """Prints the shared header (runs.print_header) over the bench_train.py runs this process started,
  given their figures: their backend and device (this process does not start JAX on the devices they
  use) and the optional packages any of them used. Returns the provenance."""
  provs = [r.get('provenance', {}) for r in results]
  packages = sorted({name for p in provs for name in p.get('packages', {})})
  return runs_lib.print_header(packages, devices_from=next((p for p in provs if p), {}))


def main(argv):
  del argv
  if FLAGS.rounds < 1:
    usage_error(f'--rounds must be >= 1; got {FLAGS.rounds}')
  for name in ('base', 'other'):
    if '--config' not in getattr(FLAGS, name):
      usage_error(f'--{name} must give bench_train.py a --config; got {getattr(FLAGS, name)!r}')
  pathlib.Path(FLAGS.cache_dir).mkdir(parents=True, exist_ok=True)
  runs, order, last_s, start = [], run_order(FLAGS.rounds), {}, time.monotonic()
  with tempfile.TemporaryDirectory() as tmp:
    for k, setup in enumerate(order):
      if not fits_budget(time.monotonic() - start, last_s.get(setup), FLAGS.time_budget_s):
        print(
          f"stopping before run {k + 1} of {len(order)}: by its setup's last run "
          f'({last_s[setup]:.0f} s) it would end past the {FLAGS.time_budget_s:.0f} s budget',
          flush=True,
        )
        break
      began = time.monotonic()
      try:
        result = bench_once(
          getattr(FLAGS, setup),
          pathlib.Path(tmp) / f'{k}.json',
          steps=FLAGS.steps,
          warmup=FLAGS.warmup,
          cache_dir=FLAGS.cache_dir,
        )
      except RuntimeError as e:  # the failed run's command and output, not this process's traceback
        sys.exit(str(e))
      last_s[setup] = time.monotonic() - began
      runs.append({'setup': setup, **result})
      print(f'run {k + 1}: {setup} {result["step_ms"]:.1f} ms', flush=True)

  median = {s: statistics.median(r['step_ms'] for r in runs if r['setup'] == s) for s in ('base', 'other')}
  overhead = median['other'] / median['base'] - 1
  print()
  prov = header(runs)
  print(
    f'{FLAGS.steps} timed steps per run'
    + (f'; {len(runs)} of {len(order)} runs (time budget)' if len(runs) < len(order) else '')
    + '\n'
  )
  print(f'- base: `{FLAGS.base}`\n- other: `{FLAGS.other}`\n')
  print('| run | setup | step ms | peak GiB | loss |\n|---|---|---|---|---|')
  for k, r in enumerate(runs):
    print(f'| {k + 1} | {r["setup"]} | {r["step_ms"]:.1f} | {r["peak_memory_GiB"]:.1f} | {r["loss"]:.4f} |')
  print(
    f'\nmedian step: base {median["base"]:.1f} ms, other {median["other"]:.1f} ms; other over base: **{overhead:+.1%}**'
  )
  if FLAGS.json_out:
    summary = {
      'base': FLAGS.base,
      'other': FLAGS.other,
      'median_step_ms': median,
      'overhead': overhead,
      'runs_planned': len(order),
    }
    pathlib.Path(FLAGS.json_out).write_text(
      json.dumps({'provenance': prov, 'summary': summary, 'runs': runs}, indent=1)
    )


if __name__ == '__main__':
  define_flags()
  app.run(main)
