"""experiments/bench/bench_compare.py: the run order, and two tiny setups compared end to end on the CPU
(real bench_train.py processes), with the overhead checked against the runs it reports."""

import json
import pathlib
import statistics
import subprocess
import sys

import pytest

from experiments import runs
from experiments.bench import bench_compare

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = (
  '--config.train.batch_size=8 --config.train.seq_len=32 --config.model.d_model=32 '
  '--config.model.num_layers=1 --config.model.num_heads=2 --config.model.mlp_dim=64'
)


def test_run_order_alternates_which_setup_goes_first():
  assert bench_compare.run_order(3) == ['base', 'other', 'other', 'base', 'base', 'other']
  assert bench_compare.run_order(1) == ['base', 'other']


def compare(tmp_path, other, rounds=1, *extra):
  out = tmp_path / 'compare.json'
  cmd = [
    sys.executable,
    '-m',
    'experiments.bench.bench_compare',
    f'--rounds={rounds}',
    '--steps=1',
    '--warmup=1',
    f'--cache_dir={tmp_path / "cache"}',
    f'--json_out={out}',
    f'--base=--config=configs/default.py {TINY}',
    f'--other={other} {TINY}',
    *extra,
  ]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600), out


def test_a_time_budget_starts_no_run_that_would_end_past_it():
  assert bench_compare.fits_budget(100.0, None, None) and bench_compare.fits_budget(100.0, 30.0, None)
  assert bench_compare.fits_budget(500.0, None, 10.0)  # a setup's first run always runs
  assert bench_compare.fits_budget(70.0, 30.0, 100.0) and not bench_compare.fits_budget(70.1, 30.0, 100.0)


def test_a_cut_short_comparison_still_reports_its_runs(tmp_path):
  proc, out = compare(tmp_path, '--config=configs/default.py', 2, '--time_budget_s=0.001')
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  assert [r['setup'] for r in report['runs']] == ['base', 'other'] and report['summary']['runs_planned'] == 4
  assert 'stopping before run 3 of 4' in proc.stdout and '2 of 4 runs (time budget)' in proc.stdout
  # the header: this process's command, the device its bench_train.py runs ran on
  child = report['runs'][0]['provenance']
  assert child['command'].startswith('python -m experiments.bench.bench_train --steps=1 ')
  assert report['provenance']['command'].startswith('python -m experiments.bench.bench_compare --rounds=2 ')
  assert (report['provenance']['backend'], report['provenance']['device']) == (child['backend'], child['device'])
  assert runs.header_line(report['provenance']) in proc.stdout


@pytest.mark.long
def test_compares_two_setups_on_one_device(tmp_path):
  proc, out = compare(tmp_path, '--config=configs/default.py:nope', rounds=2)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  runs = report['runs']
  assert [r['setup'] for r in runs] == ['base', 'other', 'other', 'base']
  times = {s: [r['step_ms'] for r in runs if r['setup'] == s] for s in ('base', 'other')}
  want = statistics.median(times['other']) / statistics.median(times['base']) - 1
  assert abs(report['summary']['overhead'] - want) < 1e-12
  assert f'**{want:+.1%}**' in proc.stdout and proc.stdout.count('\n| ') == 5  # header + 4 runs
  assert any((tmp_path / 'cache').iterdir())  # the runs shared a compile cache


def test_a_failing_setup_is_one_error_with_its_command(tmp_path):
  proc, out = compare(tmp_path, '--config=configs/default.py:bogus')
  assert proc.returncode != 0 and not out.exists()
  assert 'bench_compare: this run failed' in proc.stderr and "unknown variant 'bogus'" in proc.stderr
  assert 'bench_compare.py", line' not in proc.stderr  # no traceback of bench_compare itself
