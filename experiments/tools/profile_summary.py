"""Where a profiled step's device time goes: kernel time by kind and the top ops, per step.

    python -m experiments.bench.bench_train --config=configs/bench_350m.py --profile_dir=/tmp/prof
    python -m experiments.tools.profile_summary /tmp/prof [--steps=3] [--top=25]

Reads the newest perfetto_trace.json.gz under the directory (jax.profiler.trace with
create_perfetto_trace=True; bench_train.py profiles 3 steps), sums the durations of the complete
('X') events of every device process ('/device:GPU:0', ...) by event name, and prints ms per step
for each kind (matmul, attention, collective, custom call, other fusion or kernel) and for the
`--top` names. Device events can overlap (several streams), so the sum can exceed the step time.
A CPU trace has no device process and is refused.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os

from absl import app, flags

flags.DEFINE_integer('steps', 3, 'steps the trace holds (bench_train.py --profile_dir profiles 3)')
flags.DEFINE_integer('top', 25, 'how many op names to list')
FLAGS = flags.FLAGS

# First match wins; matched against the lower-cased event name.
KINDS = (
    ('collective', ('nccl', 'all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective')),
    ('attention', ('cudnn', 'flash', 'fmha', 'attention')),
    ('matmul', ('gemm', 'cublas', 'nvjet', 'matmul', 'dot', 'xmma', 'cutlass', 'wgmma')),
    ('custom call', ('custom-call', 'custom_call', 'triton', 'pallas', 'attnres_phase1')),
)


def kind_of(name: str) -> str:
  lower = name.lower()
  for kind, needles in KINDS:
    if any(n in lower for n in needles):
      return kind
  return 'other fusion or kernel'


def device_events(trace: dict) -> list[dict]:
  """The complete ('X') events of the trace's device processes ('/device:...')."""
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  devices = {e['pid'] for e in events if e.get('ph') == 'M' and e.get('name') == 'process_name'
             and str(e['args'].get('name', '')).startswith('/device:')}
  return [e for e in events if e.get('ph') == 'X' and e['pid'] in devices]


def summarise(events: list[dict], steps: int) -> tuple[dict, list[tuple[str, float]]]:
  """({kind: ms per step}, [(name, ms per step)] longest first); trace durations are in us."""
  by_name = collections.Counter()
  for e in events:
    by_name[e['name']] += e.get('dur', 0.0)
  by_kind = collections.Counter()
  for name, us in by_name.items():
    by_kind[kind_of(name)] += us
  per_step = lambda us: us / 1e3 / steps
  return ({k: per_step(us) for k, us in by_kind.most_common()},
          [(n, per_step(us)) for n, us in by_name.most_common()])


def newest_trace(directory: str) -> str:
  paths = glob.glob(os.path.join(directory, '**', 'perfetto_trace.json.gz'), recursive=True)
  if not paths:
    raise SystemExit(f'profile_summary: no perfetto_trace.json.gz under {directory!r} '
                     '(run bench_train.py with --profile_dir first)')
  return max(paths, key=os.path.getmtime)


def main(argv):
  if len(argv) != 2:
    raise app.UsageError('usage: profile_summary.py PROFILE_DIR [--steps=N] [--top=N]')
  path = newest_trace(argv[1])
  with gzip.open(path) as f:
    events = device_events(json.load(f))
  if not events:
    raise SystemExit(f'profile_summary: {path} has no device events (a CPU trace?)')
  by_kind, by_name = summarise(events, FLAGS.steps)
  print(f'{path}: {len(events)} events, {sum(by_kind.values()):.1f} ms per step in all '
        f'({FLAGS.steps} steps)\n')
  print('| kind | ms / step |\n|---|---|')
  for kind, ms in by_kind.items():
    print(f'| {kind} | {ms:.2f} |')
  print(f'\n| op (top {FLAGS.top}) | kind | ms / step |\n|---|---|---|')
  for name, ms in by_name[:FLAGS.top]:
    print(f'| {name[:90]} | {kind_of(name)} | {ms:.2f} |')


if __name__ == '__main__':
  app.run(main)
