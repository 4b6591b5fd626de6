"""Where a profiled step's device time goes: kernel time by kind and the top ops, per step.

    python -m experiments.bench.bench_train --config=configs/bench_350m.py --profile_dir=/tmp/prof
    python -m experiments.tools.profile_summary /tmp/prof [--steps=3] [--top=25]

    # which JAX operation each fusion came from: dump the optimised HLO of the same run
    XLA_FLAGS=--xla_dump_to=/tmp/hlo python -m experiments.bench.bench_train ... --profile_dir=/tmp/prof
    python -m experiments.tools.profile_summary /tmp/prof --hlo_dump=/tmp/hlo

Reads the newest perfetto_trace.json.gz under the directory (jax.profiler.trace with
create_perfetto_trace=True; bench_train.py profiles 3 steps), sums the durations of the complete
('X') events of every device process ('/device:GPU:0', ...) by event name, and prints ms per step
for each kind (matmul, attention, collective, custom call, other fusion or kernel) and for the
`--top` names. Device events can overlap (several streams), so the sum can exceed the step time.
A CPU trace has no device process and is refused. With --hlo_dump, each listed op also shows the
op_name and source line XLA recorded for it in the newest optimised train-step module of the dump.

call_timelines splits annotated, synchronised calls of a trace into their kernels, the idle time
around and between them, and the host's events inside them (bench_kda.py --timeline).
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re

from absl import app, flags

from experiments.cli import usage_error

flags.DEFINE_integer('steps', 3, 'steps the trace holds (bench_train.py --profile_dir profiles 3)')
flags.DEFINE_integer('top', 25, 'how many op names to list')
flags.DEFINE_string(
  'hlo_dump',
  None,
  'an XLA_FLAGS=--xla_dump_to directory of the profiled run: name the JAX operation behind each listed op',
)
flags.DEFINE_string(
  'module',
  'train_step',
  "with --hlo_dump: the jitted function whose optimised module names the ops ('step' for bench_decode's steps)",
)
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
  devices = {
    e['pid']
    for e in events
    if e.get('ph') == 'M' and e.get('name') == 'process_name' and str(e['args'].get('name', '')).startswith('/device:')
  }
  return [e for e in events if e.get('ph') == 'X' and e['pid'] in devices]


def read_device_events(path: str) -> list[dict]:
  """device_events of a perfetto_trace.json.gz file."""
  return device_events(read_trace(path))


def read_trace(path: str) -> dict:
  """A perfetto_trace.json.gz file's JSON."""
  with gzip.open(path) as f:
    return json.load(f)


def call_timelines(trace: dict, prefix: str, min_us: float = 15.0) -> list[dict]:
  """For each host event whose name starts with `prefix` (a jax.profiler.TraceAnnotation around
  one synchronised call), in order: its host span and what happened inside it, in us from its
  start. 'host': (offset, duration, name) of the other host events of at least min_us;
  'kernels': (offset, duration, gap since the previous kernel, name) of the device events that
  start inside the span; 'kernel_us' their sum, 'lead_us' the time before the first, 'gaps_us'
  the idle time between them, 'tail_us' the time from the last one's end to the span's end."""
  events = trace['traceEvents'] if isinstance(trace, dict) else trace
  on_device = {id(e) for e in device_events(trace)}
  host = sorted((e for e in events if e.get('ph') == 'X' and id(e) not in on_device), key=lambda e: e['ts'])
  kernels = sorted((e for e in events if id(e) in on_device), key=lambda e: e['ts'])
  out = []
  for call in (e for e in host if e['name'].startswith(prefix)):
    start, end = call['ts'], call['ts'] + call['dur']
    inside = [e for e in kernels if start <= e['ts'] <= end]
    timeline, last_end, gaps = [], None, 0.0
    for e in inside:
      gap = 0.0 if last_end is None else max(0.0, e['ts'] - last_end)
      gaps += gap
      timeline.append((e['ts'] - start, e['dur'], gap, e['name']))
      last_end = e['ts'] + e['dur'] if last_end is None else max(last_end, e['ts'] + e['dur'])
    out.append(
      {
        'name': call['name'],
        'span_us': call['dur'],
        'host': [
          (e['ts'] - start, e['dur'], e['name'])
          for e in host
          if e is not call and start <= e['ts'] <= end and e['dur'] >= min_us
        ],
        'kernels': timeline,
        'kernel_us': sum(e['dur'] for e in inside),
        'lead_us': inside[0]['ts'] - start if inside else call['dur'],
        'gaps_us': gaps,
        'tail_us': end - last_end if inside else 0.0,
      }
    )
  return out


def summarise(events: list[dict], steps: int) -> tuple[dict, list[tuple[str, float]]]:
  """({kind: ms per step}, [(name, ms per step)] longest first); trace durations are in us."""
  by_name = collections.Counter()
  for e in events:
    by_name[e['name']] += e.get('dur', 0.0)
  by_kind = collections.Counter()
  for name, us in by_name.items():
    by_kind[kind_of(name)] += us
  per_step = lambda us: us / 1e3 / steps
  return ({k: per_step(us) for k, us in by_kind.most_common()}, [(n, per_step(us)) for n, us in by_name.most_common()])


def newest_trace(directory: str) -> str:
  paths = glob.glob(os.path.join(directory, '**', 'perfetto_trace.json.gz'), recursive=True)
  if not paths:
    raise SystemExit(
      f'profile_summary: no perfetto_trace.json.gz under {directory!r} (run bench_train.py with --profile_dir first)'
    )
  return max(paths, key=os.path.getmtime)


_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = ')


def hlo_origins(directory: str, module: str = 'train_step') -> dict[str, str]:
  """{op name as the trace spells it ('.' -> '_'): 'op_name (file:line)'} from the newest optimised
  HLO module of the jitted function `module` in an XLA dump directory."""
  paths = glob.glob(os.path.join(directory, f'*.jit_{module}.*after_optimizations.txt'))
  if not paths:
    raise SystemExit(
      f'profile_summary: no optimised HLO of {module!r} (*.jit_{module}.*after_optimizations.txt) under {directory!r}'
    )
  origins = {}
  with open(max(paths, key=os.path.getmtime)) as f:
    for line in f:
      name, op = _INSTRUCTION.match(line), re.search(r'op_name="([^"]*)"', line)
      if not (name and op):
        continue
      src, at = re.search(r'source_file="([^"]*)"', line), re.search(r'source_line=(\d+)', line)
      where = f' ({os.path.basename(src.group(1))}:{at.group(1) if at else "?"})' if src else ''
      origins.setdefault(name.group(1).replace('.', '_'), op.group(1)[-90:] + where)
  return origins


def main(argv):
  if len(argv) != 2:
    usage_error('usage: profile_summary.py PROFILE_DIR [--steps=N] [--top=N]')
  path = newest_trace(argv[1])
  events = read_device_events(path)
  if not events:
    raise SystemExit(f'profile_summary: {path} has no device events (a CPU trace?)')
  by_kind, by_name = summarise(events, FLAGS.steps)
  print(f'{path}: {len(events)} events, {sum(by_kind.values()):.1f} ms per step in all ({FLAGS.steps} steps)\n')
  print('| kind | ms / step |\n|---|---|')
  for kind, ms in by_kind.items():
    print(f'| {kind} | {ms:.2f} |')
  origins = hlo_origins(FLAGS.hlo_dump, FLAGS.module) if FLAGS.hlo_dump else None
  extra = lambda text: f' {text} |' if origins is not None else ''
  print(f'\n| op (top {FLAGS.top}) | kind | ms / step |{extra("from")}\n|---|---|---|{extra("---")}')
  for name, ms in by_name[: FLAGS.top]:
    print(f'| {name[:90]} | {kind_of(name)} | {ms:.2f} |' + extra(origins.get(name, '') if origins else ''))


if __name__ == '__main__':
  app.run(main)
