"""The longest sequence each training setup trains at on this device: bench_train.py runs at growing
train.seq_len until one runs out of memory.

    python -m experiments.bench.bench_context \
        --setups='--config=configs/bench_350m.py:long;--config=configs/bench_350m.py:long,hybrid' \
        --seq_lens=65536,131072,196608,262144,393216,524288

--setups: bench_train.py argument strings separated by ';' (configs/bench_350m.py:long is batch 1,
each layer rematerialised, the loss 4096 tokens at a time). Each setup runs at each of --seq_lens in
turn (ascending), in a fresh process with --config.train.seq_len=L appended, --steps timed steps
after --warmup, all sharing one persistent compilation cache, and stops at its first length that
runs out of memory; any other failure stops the benchmark with the run's output. Prints a Markdown
table (setup, length, step ms, tokens/s, peak GiB, status) and each setup's longest length that
trained and its first that did not. A length that fits could still be followed by a longer one
that fits between the last two tried: give finer --seq_lens there.

--compile_only runs no step: each length's step is compiled ahead of time (bench_train.py
--compile_only) and judged by XLA's planned peak per device against the device's memory, so that
lengths whose steps would take minutes (all attention grows quadratically) are sized in the time of
a compile; the table gives the planned peak instead of the timings, and a setup stops at its first
length whose plan does not fit. Run the longest that fits without it to confirm.

Each row is printed as soon as its run ends, so a benchmark cut short still shows what it measured.
--time_budget_s=S starts no run that would end past S seconds from the start, judged by the
setup's previous run scaled by (length ratio) ** 2 (the quadratic cost of attention; compile-only
runs by their previous run alone); the setup's remaining lengths are then left out (status 'not
run: time budget') and the next setup starts.
"""

import pathlib
import tempfile
import time

from absl import app, flags

from experiments.bench import bench_compare
from experiments.cli import usage_error

FLAGS = flags.FLAGS
OUT_OF_MEMORY = ('RESOURCE_EXHAUSTED', 'out of memory', 'Out of memory', 'OOM')


def define_flags():
  """The command line (defined only when run as a script, so that tests can import the module)."""
  flags.DEFINE_string('setups', None, "bench_train.py argument strings, separated by ';'")
  flags.DEFINE_list('seq_lens', ['65536', '131072', '262144', '524288'], 'sequence lengths, ascending')
  flags.DEFINE_integer('steps', 2, 'timed steps per run')
  flags.DEFINE_integer('warmup', 1, 'untimed steps per run (the first compiles)')
  flags.DEFINE_string('cache_dir', str(bench_compare.ROOT / 'runs/xla_cache'), 'persistent XLA compilation cache')
  flags.DEFINE_bool('compile_only', False, "size each length by XLA's planned peak of the compiled step; run nothing")
  flags.DEFINE_float('time_budget_s', None, 'start no run that would end past this many seconds (the docstring)')
  flags.mark_flags_as_required(['setups'])


def parse_lengths(values: list[str]) -> list[int]:
  """--seq_lens as ascending positive integers, or a ValueError naming the flag."""
  try:
    lengths = [int(v) for v in values]
  except ValueError:
    raise ValueError(f'--seq_lens={",".join(values)}: expected integers') from None
  if not lengths or any(n < 1 for n in lengths) or lengths != sorted(set(lengths)):
    raise ValueError(f'--seq_lens={",".join(values)}: expected distinct positive lengths in ascending order')
  return lengths


def out_of_memory(error: Exception) -> bool:
  return any(marker in str(error) for marker in OUT_OF_MEMORY)


TRAINED, FITS, OVER = 'trained', 'fits (planned)', 'over the memory (planned)'
NOT_RUN = 'not run: time budget'


def longest(setup: str, lengths: list[int], run, time_left=None, growth: float = 2.0, clock=time.monotonic):
  """Yields the rows of one setup: run(args) -> bench_train's figures at each length in turn, until
  the first that runs out of memory (its row has status 'out of memory') or, from a compile-only run
  (figures with 'fits'), whose planned peak does not fit (status OVER). time_left: None, or a
  callable giving the seconds left of the budget; a length whose run would take longer, judged by
  the previous run's seconds (by `clock`) times (length ratio) ** growth, is not started (status
  NOT_RUN)."""
  previous = None  # (length, seconds) of the setup's last run
  for length in lengths:
    if time_left is not None and previous is not None:
      estimate = previous[1] * (length / previous[0]) ** growth
      if estimate > time_left():
        yield {'setup': setup, 'seq_len': length, 'status': NOT_RUN}
        return
    start = clock()
    try:
      result = run(f'{setup} --config.train.seq_len={length}')
    except RuntimeError as e:
      if not out_of_memory(e):
        raise
      yield {'setup': setup, 'seq_len': length, 'status': 'out of memory'}
      return
    previous = (length, clock() - start)
    status = TRAINED if 'fits' not in result else FITS if result['fits'] is not False else OVER
    yield {'setup': setup, 'seq_len': length, **result, 'status': status}
    if status == OVER:
      return


def _columns(planned: bool) -> str:
  return 'planned peak GiB | device GiB' if planned else 'step ms | tokens/s | peak GiB'


def row_line(r: dict, planned: bool) -> str:
  """One row of the Markdown table (planned: compile-only columns)."""
  if 'planned_peak_GiB' in r:
    device = '-' if r['device_memory_GiB'] is None else f'{r["device_memory_GiB"]:.1f}'
    figures = f'{r["planned_peak_GiB"]:.1f} | {device}'
  elif r['status'] == TRAINED:
    tokens_s = r['batch'] * r['seq_len'] / r['step_ms'] * 1e3
    figures = f'{r["step_ms"]:.1f} | {tokens_s:,.0f} | {r["peak_memory_GiB"]:.1f}'
  else:
    figures = ' | '.join('-' * (_columns(planned).count('|') + 1))
  return f'| `{r["setup"]}` | {r["seq_len"]} | {figures} | {r["status"]} |'


def table_header(planned: bool) -> str:
  columns = _columns(planned)
  return f'| setup | seq_len | {columns} | status |\n' + '|---|---|' + '---|' * (columns.count('|') + 2)


def table(rows: list[dict]) -> str:
  planned = any('planned_peak_GiB' in r for r in rows)
  return '\n'.join([table_header(planned), *(row_line(r, planned) for r in rows)])


def summary(setup: str, rows: list[dict]) -> str:
  fitting = [r for r in rows if r['status'] in (TRAINED, FITS)]
  failed = [r for r in rows if r['status'] not in (TRAINED, FITS)]
  planned = any('planned_peak_GiB' in r for r in rows)
  if fitting:
    best = f'longest that fits {fitting[-1]["seq_len"]}' if planned else f'longest trained {fitting[-1]["seq_len"]}'
  else:
    best = 'none fits' if planned else 'none trained'
  if failed and failed[0]['status'] == NOT_RUN:
    limit = f', {failed[0]["seq_len"]} not run (time budget)'
  elif failed:
    limit = f', {failed[0]["status"]} at {failed[0]["seq_len"]}'
  else:
    limit = ', none tried was over the memory' if planned else ', none tried ran out of memory'
  return f'- `{setup}`: {best}{limit}'


def main(argv):
  del argv
  try:
    lengths = parse_lengths(FLAGS.seq_lens)
  except ValueError as e:
    usage_error(str(e))
  setups = [s.strip() for s in FLAGS.setups.split(';') if s.strip()]
  if not setups or any('--config' not in s for s in setups):
    usage_error(f'--setups must give bench_train.py a --config in each setup; got {FLAGS.setups!r}')
  pathlib.Path(FLAGS.cache_dir).mkdir(parents=True, exist_ok=True)
  rows, start = [], time.monotonic()
  time_left = None if FLAGS.time_budget_s is None else lambda: FLAGS.time_budget_s - (time.monotonic() - start)
  print(table_header(FLAGS.compile_only), flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    counter = iter(range(10**6))

    def run(args):
      out = pathlib.Path(tmp) / f'{next(counter)}.json'
      args += ' --compile_only' if FLAGS.compile_only else ''
      return bench_compare.bench_once(args, out, steps=FLAGS.steps, warmup=FLAGS.warmup, cache_dir=FLAGS.cache_dir)

    for setup in setups:
      for row in longest(setup, lengths, run, time_left, growth=0.0 if FLAGS.compile_only else 2.0):
        rows.append(row)
        print(row_line(row, FLAGS.compile_only), flush=True)
  print()
  bench_compare.header([r for r in rows if 'provenance' in r])
  print('compiled, not run\n' if FLAGS.compile_only else f'{FLAGS.steps} timed steps per run\n')
  print(table(rows) + '\n')
  for setup in setups:
    print(summary(setup, [r for r in rows if r['setup'] == setup]))


if __name__ == '__main__':
  define_flags()
  app.run(main)
