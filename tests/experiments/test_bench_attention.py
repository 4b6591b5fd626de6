"""experiments/bench/bench_attention.py on the CPU: tiny shapes through 'xla' (timed) and the GPU
implementations (a cell saying why they cannot run here), the shape parser and the FLOP count."""

import re

import pytest

from experiments.bench import bench_attention


def test_tiny_shapes_give_one_row_per_implementation_and_max_logit_setting():
  got = list(bench_attention.rows(['2x16x16x2x1x8x8', '2x1x16x2x2x8x8'], ['xla', 'tokamax'], repeats=1, warmup=1))
  assert [r[1:3] for r in got] == [
    ['xla', 'no'],
    ['xla', 'yes'],
    ['tokamax', 'no'],
    ['tokamax', 'yes'],
    ['xla (decode_attention)', '-'],
    ['tokamax', '-'],
  ]
  timed = r'\d+\.\d\d \(\d+\.\d\d\)'
  for row in got[:2]:
    assert re.fullmatch(timed + r', .* TFLOP/s', row[3]) and re.fullmatch(timed, row[4]), row
  assert re.fullmatch(timed + r', .* TFLOP/s', got[4][3]) and got[4][4] == '-'  # decoding: forward only
  assert all(cell.startswith('n/a: needs bfloat16') for row in got if row[1] == 'tokamax' for cell in row[3:])


def test_xla_is_skipped_above_the_length_limit():
  (row, _) = bench_attention.rows(['1x8x32x1x1x8x8'], ['xla'], skip_xla_above=16)
  assert row[3] == row[4] == 'skipped (S > --skip_xla_above=16)'


def test_shapes_and_flops():
  assert bench_attention.parse_shape('mla_4k') == (8, 4096, 4096, 16, 16, 192, 128)
  with pytest.raises(ValueError, match="'8x4096' is neither a name"):
    bench_attention.parse_shape('8x4096')
  # T == S: T (T + 1) / 2 pairs; T < S: each query also sees the S - T earlier keys.
  assert bench_attention.forward_tflop((1, 4, 4, 1, 1, 3, 2)) == 2 * 10 * 5 / 1e12
  assert bench_attention.forward_tflop((1, 2, 5, 1, 1, 3, 2)) == 2 * (2 * 3 + 3) * 5 / 1e12
  # experiments/results/bench_attention.md's cuDNN figure: 0.96 ms at (8, 4096, 16, 128) is ~575 TFLOP/s.
  assert abs(bench_attention.forward_tflop(bench_attention.SHAPES['mha_4k']) / 0.96e-3 - 573) < 2


@pytest.mark.parametrize('impls', [['xla'], ['cudnn', 'xla'], ['tokamax'], ['gpu']])
def test_the_header_names_tokamax_where_an_impl_runs_it(impls):
  """'gpu' runs tokamax for the rows with max logits (every shape but a decode step's), so its
  header states tokamax's version as 'tokamax''s does."""
  import jax
  import jax.numpy as jnp

  from kimijax.ops import attention as attention_ops

  q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
  runs_tokamax = any(
    impl == 'tokamax' or (impl == 'gpu' and attention_ops.gpu_choice(q, q, return_max_logits=True) == 'tokamax')
    for impl in impls
  )
  assert bench_attention.header_packages(impls) == (['tokamax'] if runs_tokamax else [])
