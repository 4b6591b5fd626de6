"""experiments/bench/bench_train.py on the CPU: a tiny hybrid's step with packed documents (--documents),
whose segment ids and positions reach the model, and the flag's errors."""

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import cpu_subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = [
  '--config=configs/default.py',
  '--config.train.batch_size=2',
  '--config.train.seq_len=64',
  '--config.model.d_model=32',
  '--config.model.num_layers=2',
  '--config.model.num_heads=2',
  '--config.model.mlp_dim=64',
  '--config.model.layer_pattern=KA',
  '--steps=1',
  '--warmup=1',
]


def bench(tmp_path, *extra):
  out = tmp_path / 'bench.json'
  cmd = [sys.executable, '-m', 'experiments.bench.bench_train', *TINY, f'--json_out={out}', *extra]
  return subprocess.run(cmd, cwd=ROOT, env=cpu_subprocess_env(), capture_output=True, text=True, timeout=600), out


@pytest.mark.long  # ~50 s
def test_a_step_on_packed_documents(tmp_path):
  proc, out = bench(tmp_path, '--documents=8,24')
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(out.read_text())
  assert result['documents'] == '8,24' and result['loss'] > 0
  assert result['provenance']['command'].startswith('python -m experiments.bench.bench_train --config=')
  assert result['provenance']['backend'] == 'cpu' and result['provenance']['packages'] == {}


def test_bad_documents_flag_is_one_line(tmp_path):
  proc, _ = bench(tmp_path, '--documents=24')
  assert proc.returncode != 0 and "--documents='24': expected 'MIN,MAX'" in proc.stderr
  proc, _ = bench(tmp_path, '--documents=8,24', '--config.model.attn_impl=cudnn')
  assert proc.returncode != 0 and "model.attn_impl='cudnn' has no document mask" in proc.stderr


def test_compile_only_reports_xlas_plan_without_running(tmp_path):
  """--compile_only: XLA's planned peak of the step (no loss: no step ran), against the host's
  memory on a CPU; it grows with the sequence length; with --documents it is one usage line."""
  plans = []
  for seq_len in (64, 256):
    proc, out = bench(tmp_path, '--compile_only', f'--config.train.seq_len={seq_len}')
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert 'loss' not in result and 'step_ms' not in result
    assert result['seq_len'] == seq_len and result['fits'] is True
    assert 0 < result['planned_peak_GiB'] < result['device_memory_GiB']
    plans.append(result['planned_peak_GiB'])
  assert plans[1] > plans[0]
  proc, _ = bench(tmp_path, '--compile_only', '--documents=8,24')
  assert proc.returncode != 0 and '--compile_only takes no --documents' in proc.stderr
