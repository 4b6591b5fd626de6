"""experiments/bench/bench_context.py: each setup runs at growing lengths until the first that runs
out of memory; other failures stop it; bad flags are one usage line."""

import pathlib
import subprocess
import sys

import pytest

from experiments.bench import bench_context

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fake_run(limit, calls):
  """bench_train as seen through bench_compare.bench_once: figures up to `limit` tokens, an XLA
  out-of-memory error past it."""

  def run(args):
    calls.append(args)
    length = int(args.rsplit('--config.train.seq_len=', 1)[1])
    if length > limit:
      raise RuntimeError(
        'bench_compare: this run failed (exit 1):\n  ...\nXlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory'
      )
    return {
      'device': 'fake',
      'batch': 1,
      'seq_len': length,
      'step_ms': length / 1000,
      'peak_memory_GiB': length / 2**14,
    }

  return run


def test_stops_at_the_first_length_out_of_memory():
  calls = []
  rows = list(bench_context.longest('--config=c.py:long', [1024, 2048, 4096, 8192], fake_run(2048, calls)))
  assert calls == [f'--config=c.py:long --config.train.seq_len={n}' for n in (1024, 2048, 4096)]
  assert [(r['seq_len'], r['status']) for r in rows] == [(1024, 'trained'), (2048, 'trained'), (4096, 'out of memory')]
  text = bench_context.table(rows)
  # tokens/s = batch * seq_len / step seconds = 1000 / 1e-3 for the fake figures
  assert '| `--config=c.py:long` | 2048 | 2.0 | 1,000,000 | 0.1 | trained |' in text
  assert '| `--config=c.py:long` | 4096 | - | - | - | out of memory |' in text
  assert bench_context.summary('s', rows) == '- `s`: longest trained 2048, out of memory at 4096'
  assert bench_context.summary('s', rows[:1]) == '- `s`: longest trained 1024, none tried ran out of memory'


def test_other_failures_are_not_taken_for_out_of_memory():
  def run(args):
    raise RuntimeError("bench_compare: this run failed (exit 1):\nConfigError: unknown variant 'bogus'")

  with pytest.raises(RuntimeError, match='bogus'):
    list(bench_context.longest('--config=c.py:bogus', [1024], run))


def test_lengths_must_ascend():
  assert bench_context.parse_lengths(['1024', '4096']) == [1024, 4096]
  for bad in (['4096', '1024'], ['1024', '1024'], ['0'], ['1k']):
    with pytest.raises(ValueError, match='--seq_lens'):
      bench_context.parse_lengths(bad)


def test_bad_flags_are_one_usage_line():
  cmd = [sys.executable, '-m', 'experiments.bench.bench_context', '--setups=--config=x.py', '--seq_lens=8,4']
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0 and 'ascending order' in proc.stderr and 'Traceback' not in proc.stderr


def test_compile_only_stops_at_the_first_plan_over_the_memory():
  """Compile-only figures (bench_train --compile_only): each length fits or not by XLA's plan; the
  setup stops at the first that does not, and the table gives the planned peaks."""
  calls = []

  def run(args):
    calls.append(args)
    length = int(args.rsplit('--config.train.seq_len=', 1)[1])
    planned = length / 2**10
    return {'batch': 1, 'seq_len': length, 'planned_peak_GiB': planned, 'device_memory_GiB': 3.0, 'fits': planned <= 3}

  rows = list(bench_context.longest('--config=c.py:long', [1024, 2048, 4096, 8192], run))
  assert len(calls) == 3
  assert [(r['seq_len'], r['status']) for r in rows] == [
    (1024, bench_context.FITS),
    (2048, bench_context.FITS),
    (4096, bench_context.OVER),
  ]
  text = bench_context.table(rows)
  assert text.splitlines()[0] == '| setup | seq_len | planned peak GiB | device GiB | status |'
  assert text.splitlines()[1] == '|---|---|---|---|---|'
  assert f'| `--config=c.py:long` | 4096 | 4.0 | 3.0 | {bench_context.OVER} |' in text
  assert bench_context.summary('s', rows) == f'- `s`: longest that fits 2048, {bench_context.OVER} at 4096'


def test_a_length_whose_run_would_pass_the_budget_is_not_started():
  """Each fake run takes 10 s on the fake clock, so after 2048 the run at 4096 is judged at
  10 * 2 ** 2 = 40 s: started with 50 s left, not with 30."""

  def lengths_run(seconds_left):
    now, calls = [0.0], []

    def run(args):
      now[0] += 10.0
      return fake_run(10**9, calls)(args)

    rows = list(bench_context.longest('s', [2048, 4096], run, time_left=lambda: seconds_left, clock=lambda: now[0]))
    return [int(a.rsplit('=', 1)[1]) for a in calls], rows

  assert lengths_run(50.0)[0] == [2048, 4096]
  calls, rows = lengths_run(30.0)
  assert calls == [2048]
  assert [(r['seq_len'], r['status']) for r in rows] == [(2048, 'trained'), (4096, bench_context.NOT_RUN)]
  assert bench_context.summary('s', rows) == '- `s`: longest trained 2048, 4096 not run (time budget)'
