"""experiments/bench_compare.py: the run order, and two tiny setups compared end to end on the CPU
(real bench_train.py processes), with the overhead checked against the runs it reports."""

import json
import pathlib
import statistics
import subprocess
import sys

from experiments import bench_compare

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ('--config.train.batch_size=8 --config.train.seq_len=32 --config.model.d_model=32 '
        '--config.model.num_layers=1 --config.model.num_heads=2 --config.model.mlp_dim=64')


def test_run_order_alternates_which_setup_goes_first():
  assert bench_compare.run_order(3) == ['base', 'other', 'other', 'base', 'base', 'other']
  assert bench_compare.run_order(1) == ['base', 'other']


def compare(tmp_path, other, rounds=1):
  out = tmp_path / 'compare.json'
  cmd = [sys.executable, str(ROOT / 'experiments/bench_compare.py'), f'--rounds={rounds}',
         '--steps=1', '--warmup=1', f'--cache_dir={tmp_path / "cache"}', f'--json_out={out}',
         f'--base=--config=configs/default.py {TINY}', f'--other={other} {TINY}']
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600), out


def test_compares_two_setups_on_one_device(tmp_path):
  proc, out = compare(tmp_path, '--config=configs/default.py:nope', rounds=2)
  assert proc.returncode == 0, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  runs = report['runs']
  assert [r['setup'] for r in runs] == ['base', 'other', 'other', 'base']
  times = {s: [r['step_ms'] for r in runs if r['setup'] == s] for s in ('base', 'other')}
  want = statistics.median(times['other']) / statistics.median(times['base']) - 1
  assert abs(report['summary']['overhead'] - want) < 1e-12
  assert f"**{want:+.1%}**" in proc.stdout and proc.stdout.count('\n| ') == 5   # header + 4 runs
  assert any((tmp_path / 'cache').iterdir())                     # the runs shared a compile cache


def test_a_failing_setup_is_one_error_with_its_command(tmp_path):
  proc, out = compare(tmp_path, '--config=configs/default.py:bogus')
  assert proc.returncode != 0 and not out.exists()
  assert 'bench_compare: this run failed' in proc.stderr and "unknown variant 'bogus'" in proc.stderr
