"""experiments/bench/bench_dot_f32.py on the CPU at tiny shapes: both products under both
algorithms and the router as router_logits computes it, timed, and (XLA:CPU multiplies in float32
under either algorithm; the router's bf16 terms of W_r sum back to it to float32's precision) within
1e-6 of HIGHEST."""

import re

from experiments.bench import bench_dot_f32


def test_tiny_shapes():
  rows = list(bench_dot_f32.rows(tokens=64, d_model=32, experts=8, blocks=12, width=48, repeats=1, warmup=1))
  assert [r[:2] for r in rows] == [
    ('router', 'HIGHEST'),
    ('router', 'BF16_BF16_F32_X6'),
    ('router', bench_dot_f32.ROUTER_LOGITS),
    ('block sum', 'HIGHEST'),
    ('block sum', 'BF16_BF16_F32_X6'),
  ]
  for _, _, ms, errors in rows:
    assert re.fullmatch(r'\d+\.\d{3} \(\d+\.\d{3}\)', ms)
    assert all(float(e) <= 1e-6 for e in errors.split(', '))
