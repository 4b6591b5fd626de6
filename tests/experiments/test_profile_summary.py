"""experiments/tools/profile_summary.py on a hand-made trace whose totals are known."""

import gzip
import json

import pytest

from experiments.tools import profile_summary


def trace():
  meta = lambda pid, name: {'ph': 'M', 'name': 'process_name', 'pid': pid, 'args': {'name': name}}
  x = lambda pid, name, dur: {'ph': 'X', 'pid': pid, 'tid': 1, 'ts': 0.0, 'dur': dur, 'name': name}
  return {
    'traceEvents': [
      meta(1, '/host:CPU'),
      meta(2, '/device:GPU:0'),
      x(1, 'python step', 9e6),  # host: ignored
      x(2, 'sm90_xmma_gemm_bf16', 3000.0),
      x(2, 'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT', 3000.0),
      x(2, 'cudnn_flash_fprop', 1500.0),
      x(2, 'loop_add_fusion', 600.0),
      x(2, 'nccl_all_gather', 300.0),
      x(2, 'triton_max_logits', 900.0),
    ]
  }


def test_summary_by_kind_and_name():
  by_kind, by_name = profile_summary.summarise(profile_summary.device_events(trace()), steps=3)
  # 6000 us of gemm over 3 steps = 2 ms per step, and so on; the host event is not counted.
  assert by_kind == pytest.approx(
    {'matmul': 2.0, 'attention': 0.5, 'custom call': 0.3, 'other fusion or kernel': 0.2, 'collective': 0.1}
  )
  assert by_name[0] == ('sm90_xmma_gemm_bf16', pytest.approx(1.0))
  assert [n for n, _ in by_name] == [
    'sm90_xmma_gemm_bf16',
    'nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT',
    'cudnn_flash_fprop',
    'triton_max_logits',
    'loop_add_fusion',
    'nccl_all_gather',
  ]


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


def test_hlo_origins_name_the_jax_operation_of_each_fusion(tmp_path):
  """A fusion's trace name ('loop_add_fusion_18') maps to the op_name and source line recorded
  in the newest optimised module of the named jitted function (the train step by default); other
  modules of the dump are not read."""
  line = (
    '  %loop_add_fusion.18 = bf16[16,4096,1024]{2,1,0} fusion(%p0, %p1), kind=kLoop, '
    'calls=%fused_add.18, metadata={op_name="jit(train_step)/jvp(Model)/layer_3/kda/add" '
    'source_file="/repo/kimijax/layers/kda.py" source_line=120}\n'
  )
  (tmp_path / 'module_0101.jit_train_step.sm_9.0_gpu_after_optimizations.txt').write_text(
    'HloModule jit_train_step\n' + line + '  ROOT %tuple.1 = (f32[]) tuple(%x)\n'
  )
  (tmp_path / 'module_0001.jit_other.sm_9.0_gpu_after_optimizations.txt').write_text(
    line.replace('layer_3', 'elsewhere')
  )
  (tmp_path / 'module_0002.jit_step.sm_9.0_gpu_after_optimizations.txt').write_text(
    line.replace('jit(train_step)/jvp(Model)/layer_3', 'jit(step)/layer_5')
  )
  origins = profile_summary.hlo_origins(str(tmp_path))
  assert origins == {'loop_add_fusion_18': 'jit(train_step)/jvp(Model)/layer_3/kda/add (kda.py:120)'}
  assert profile_summary.hlo_origins(str(tmp_path), 'step') == {
    'loop_add_fusion_18': 'jit(step)/layer_5/kda/add (kda.py:120)'
  }
  with pytest.raises(SystemExit, match="no optimised HLO of 'train_step'"):
    profile_summary.hlo_origins(str(tmp_path / 'missing'))


def test_call_timelines_split_each_call_into_kernels_gaps_and_host_events():
  """Two annotated calls on a hand-made trace: each one's kernels (offsets from the call's start,
  gaps since the previous kernel), the time before the first and after the last, and the host
  events inside it of at least min_us; events outside a call's span belong to no call."""
  meta = lambda pid, name: {'ph': 'M', 'name': 'process_name', 'pid': pid, 'args': {'name': name}}
  x = lambda pid, name, ts, dur: {'ph': 'X', 'pid': pid, 'tid': 1, 'ts': ts, 'dur': dur, 'name': name}
  trace = {
    'traceEvents': [
      meta(1, '/host:CPU'),
      meta(2, '/device:GPU:0'),
      x(1, 'call 2', 5000.0, 600.0),
      x(1, 'call 1', 1000.0, 1000.0),
      x(1, 'PjitFunction(fwd)', 1010.0, 40.0),
      x(1, 'short host event', 1060.0, 5.0),
      x(1, 'ConditionalThunk wait', 1300.0, 200.0),
      x(2, 'kda_scores_fwd', 1550.0, 300.0),
      x(2, 'kda_chunk_cumsum', 1100.0, 150.0),
      x(2, 'any_steep_fusion', 1250.0, 50.0),
      x(2, 'kda_state_fwd', 1900.0, 60.0),
      x(2, 'outside every call', 3000.0, 10.0),
      x(2, 'kda_chunk_cumsum', 5100.0, 400.0),
    ]
  }
  first, second = profile_summary.call_timelines(trace, 'call ', min_us=15.0)
  assert first['name'] == 'call 1' and first['span_us'] == 1000.0
  assert first['kernels'] == [
    (100.0, 150.0, 0.0, 'kda_chunk_cumsum'),
    (250.0, 50.0, 0.0, 'any_steep_fusion'),
    (550.0, 300.0, 250.0, 'kda_scores_fwd'),
    (900.0, 60.0, 50.0, 'kda_state_fwd'),
  ]
  assert first['host'] == [(10.0, 40.0, 'PjitFunction(fwd)'), (300.0, 200.0, 'ConditionalThunk wait')]
  assert (first['kernel_us'], first['lead_us'], first['gaps_us'], first['tail_us']) == (560.0, 100.0, 300.0, 40.0)
  assert second['kernels'] == [(100.0, 400.0, 0.0, 'kda_chunk_cumsum')] and second['host'] == []
  assert (second['lead_us'], second['tail_us']) == (100.0, 100.0)
