"""experiments/tools/profile_summary.py on a hand-made trace whose totals are known."""

import gzip
import json

import pytest

from experiments.tools import profile_summary


def trace():
  meta = lambda pid, name: {'ph': 'M', 'name': 'process_name', 'pid': pid, 'args': {'name': name}}
  x = lambda pid, name, dur: {'ph': 'X', 'pid': pid, 'tid': 1, 'ts': 0.0, 'dur': dur, 'name': name}
  return {'traceEvents': [
      meta(1, '/host:CPU'), meta(2, '/device:GPU:0'),
      x(1, 'python step', 9e6),                         # host: ignored
      x(2, 'sm90_xmma_gemm_bf16', 3000.0), x(2, 'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT', 3000.0),
      x(2, 'cudnn_flash_fprop', 1500.0), x(2, 'loop_add_fusion', 600.0),
      x(2, 'nccl_all_gather', 300.0), x(2, 'triton_max_logits', 900.0)]}


def test_summary_by_kind_and_name():
  by_kind, by_name = profile_summary.summarise(profile_summary.device_events(trace()), steps=3)
  # 6000 us of gemm over 3 steps = 2 ms per step, and so on; the host event is not counted.
  assert by_kind == pytest.approx({'matmul': 2.0, 'attention': 0.5, 'custom call': 0.3,
                                   'other fusion or kernel': 0.2, 'collective': 0.1})
  assert by_name[0] == ('sm90_xmma_gemm_bf16', pytest.approx(1.0))
  assert [n for n, _ in by_name] == ['sm90_xmma_gemm_bf16', 'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT',
                                     'cudnn_flash_fprop', 'triton_max_logits', 'loop_add_fusion',
                                     'nccl_all_gather']


def test_cli_reads_newest_trace_and_refuses_cpu_traces(tmp_path, capsys):
  run = tmp_path / 'plugins' / 'profile' / 'run1'
  run.mkdir(parents=True)
  with gzip.open(run / 'perfetto_trace.json.gz', 'wt') as f:
    json.dump(trace(), f)
  profile_summary.FLAGS(['profile_summary', '--steps=3'])
  try:
    profile_summary.main(['profile_summary', str(tmp_path)])
  finally:
    profile_summary.FLAGS.unparse_flags()
  out = capsys.readouterr().out
  assert '| matmul | 2.00 |' in out and '6 events' in out
  cpu = tmp_path / 'cpu' / 'perfetto_trace.json.gz'
  cpu.parent.mkdir()
  with gzip.open(cpu, 'wt') as f:
    json.dump({'traceEvents': trace()['traceEvents'][:3]}, f)
  profile_summary.FLAGS(['profile_summary'])
  try:
    with pytest.raises(SystemExit, match='no device events'):
      profile_summary.main(['profile_summary', str(cpu.parent)])
  finally:
    profile_summary.FLAGS.unparse_flags()
