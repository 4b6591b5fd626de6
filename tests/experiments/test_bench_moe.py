"""experiments/bench/bench_moe.py on the CPU: tiny shapes through 'xla' (timed) and 'tokamax' (a
cell saying why it cannot run here) in each of its three tables, the config parser and the FLOP
count."""

import re

import pytest

from experiments.bench import bench_moe

TIMED = r'\d+\.\d\d \(\d+\.\d\d\)'


def test_tiny_shapes_time_the_layer_against_the_dense_swiglu():
  rows = list(
    bench_moe.layer_rows(['4x2x16'], ['xla', 'tokamax'], tokens=64, d_model=16, shared=1, repeats=1, warmup=1)
  )
  assert [r[1] for r in rows] == ['xla', 'tokamax']
  xla, tokamax = rows
  assert xla[0] == '4x2x16 (E=4, K=2, F=16, shared=1)'
  for cell in xla[2:6]:
    assert re.fullmatch(TIMED + r', .* TFLOP/s', cell), cell
  assert re.fullmatch(r'\d+\.\d\d', xla[6])
  assert tokamax[2] == tokamax[3] == "n/a: needs an NVIDIA GPU, but JAX runs on 'cpu' here"
  assert tokamax[4:6] == xla[4:6] and tokamax[6] == '-'


def test_tiny_shapes_time_the_parts():
  rows = list(bench_moe.part_rows(['4x2x16'], ['xla', 'tokamax'], tokens=64, d_model=16, repeats=1, warmup=1))
  assert [(r[1], r[2]) for r in rows] == [
    ('router logits', '-'),
    ('routing', '-'),
    ('sort', '-'),
    ('expert load', '-'),
    ('permute', '-'),
    ('grouped swiglu', 'xla'),
    ('grouped swiglu', 'tokamax'),
    ('combine', '-'),
  ]
  by_part = {(r[1], r[2]): r for r in rows}
  assert re.fullmatch(TIMED, by_part[('sort', '-')][3]) and by_part[('sort', '-')][4] == '-'
  assert all(re.fullmatch(TIMED + r', .* TFLOP/s', c) for c in by_part[('router logits', '-')][3:])
  for part in (('routing', '-'), ('permute', '-'), ('combine', '-')):
    assert all(re.fullmatch(TIMED, c) for c in by_part[part][3:]), by_part[part]
  assert all(re.fullmatch(TIMED + r', .* TFLOP/s', c) for c in by_part[('grouped swiglu', 'xla')][3:])
  assert by_part[('grouped swiglu', 'tokamax')][3].startswith('n/a: needs an NVIDIA GPU')


def test_tiny_shapes_time_each_grouped_matmul_and_its_gradients_against_dense():
  rows = list(bench_moe.matmul_rows(['4x2x16'], ['xla', 'tokamax'], tokens=64, d_model=32, repeats=1, warmup=1))
  assert [(r[1], r[2]) for r in rows] == [
    (shape, impl) for shape in ('32 x 32', '16 x 32') for impl in ('dense', 'xla', 'tokamax')
  ]
  for row in rows:
    if row[2] == 'tokamax':
      assert row[3:6] == ["n/a: needs an NVIDIA GPU, but JAX runs on 'cpu' here"] * 3 and row[6] == '-'
    else:
      assert all(re.fullmatch(TIMED + r', .* TFLOP/s', c) for c in row[3:6]), row
      assert row[6] == '1' if row[2] == 'dense' else re.fullmatch(r'\d+\.\d\d', row[6])


def test_tiny_shapes_time_the_tile_kernels_alone():
  """Table 4: the tile kernels of 'pallas' (interpreted, tiles of 16) on the gathered slots; an impl
  without tile kernels is a cell saying so."""
  tiles = ['pallas:block_m=16/block_n=16/block_k=16']
  rows = list(bench_moe.matmul_rows(['4x2x16'], ['xla', 'pallas'], 64, 32, None, 1, 1, tiles, alone=True))
  assert [(r[1], r[2]) for r in rows] == [
    (shape, impl)
    for shape in ('32 x 32', '16 x 32')
    for impl in ('dense', 'xla', 'pallas (block_m=16/block_n=16/block_k=16)')
  ]
  for row in rows:
    if row[2] == 'xla':
      assert row[3:6] == ['n/a: no tile kernels'] * 3 and row[6] == '-'
    else:
      assert all(re.fullmatch(TIMED + r', .* TFLOP/s', c) for c in row[3:6]), row


def test_configs_and_flops():
  assert bench_moe.parse_config('64x8x512') == (64, 8, 512)
  with pytest.raises(ValueError, match="'64x8' is not 'ExKxF'"):
    bench_moe.parse_config('64x8')
  with pytest.raises(ValueError, match='top-k 9 exceeds the 8 experts'):
    bench_moe.parse_config('8x9x16')
  # Three matmuls of D x F per token and a router of D x E, 2 flops per multiply-add.
  assert bench_moe.forward_tflop(4, 3, 5, 7) == 2 * 4 * 3 * (3 * 5 + 7) / 1e12
  # 64 experts top-8 of hidden 512 over 65536 tokens of 1024: the dense baseline's hidden is 4096.
  assert bench_moe.forward_tflop(65536, 1024, 8 * 512) == pytest.approx(1.649, rel=1e-3)


def test_moe_tiles_give_each_impl_one_row_per_its_settings():
  from kernels_pallas.moe.settings import MoeSettings, MosaicMoeSettings
  from kimijax.ops.moe import BlockedSettings

  tiles = ['pallas:', 'pallas:block_m=64/warps=4', 'xla_blocked:blocks_per_group=8']
  assert bench_moe.impl_variants(['xla', 'xla_blocked', 'pallas'], tiles) == [
    ('xla', 'xla', None),
    ('xla_blocked (blocks_per_group=8)', 'xla_blocked', BlockedSettings(blocks_per_group=8)),
    ('pallas', 'pallas', MoeSettings()),
    ('pallas (block_m=64/warps=4)', 'pallas', MoeSettings(block_m=64, warps=4)),
  ]
  assert bench_moe.impl_variants(['xla_blocked'], ['pallas:block_m=64']) == [
    ('xla_blocked', 'xla_blocked', BlockedSettings())
  ]
  assert bench_moe.impl_variants(['mosaic'], ['mosaic:fused_backward=1']) == [
    ('mosaic (fused_backward=1)', 'mosaic', MosaicMoeSettings(fused_backward=1))
  ]
  with pytest.raises(ValueError, match=r"unknown keys \['block_m'\]"):
    bench_moe.impl_variants(['xla_blocked', 'pallas'], ['block_m=64'])
  with pytest.raises(ValueError, match=r"unknown keys \['block_x'\]"):
    bench_moe.impl_variants(['pallas'], ['block_x=64'])


def test_forward_backward_computes_the_forward_output():
  """The timed forward+backward returns the loss sum(y * dy) with the gradients, as a training step
  does (the gradients alone of this linear loss do not need y, and XLA would drop the forward's
  last matmul): the value against a float64 NumPy SwiGLU of the same parameters."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import linen as nn

  from kimijax.layers.mlp import SwiGLU

  x = jax.random.normal(jax.random.key(3), (2, 4, 16), jnp.float32)
  dense = SwiGLU(hidden=32, init_std=0.2, dtype=jnp.float32)
  params = dense.init(jax.random.key(0), x)['params']
  _, fwd_bwd = bench_moe._fwd_and_grad(lambda p, x: dense.apply({'params': p}, x), params, x)
  value, (d_params, dx) = fwd_bwd(params, x)
  p64 = {name: np.asarray(w, np.float64) for name, w in nn.unbox(params).items()}
  x64, dy64 = np.asarray(x, np.float64), np.asarray(fwd_bwd.keywords['dy'], np.float64)
  gate = x64 @ p64['wi_gate']
  y64 = (gate / (1 + np.exp(-gate)) * (x64 @ p64['wi_up'])) @ p64['wo']
  np.testing.assert_allclose(float(value), np.sum(y64 * dy64), rtol=1e-4)
  assert dx.shape == x.shape and set(d_params) == set(params)
