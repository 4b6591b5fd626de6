"""experiments/bench/bench_mla_decode.py on the CPU: a tiny shape through both implementations ('pallas'
interpreted), one row each with its timing, bandwidth, error against 'xla' and speed-up; the bytes read."""

import re

from experiments.bench import bench_mla_decode


def test_tiny_shape_gives_one_row_per_rope_dim_and_impl():
  shape = dict(batch=2, heads=4, rank=32, rope_dims=[16, 0], tiles='block_s=16', repeats=1, warmup=1)
  got = list(bench_mla_decode.rows([48], ['pallas', 'xla'], copy_gbs=1.0, **shape))
  assert [r[:3] for r in got] == [
    ['16', '48', 'pallas'],
    ['16', '48', 'xla'],
    ['0', '48', 'pallas'],
    ['0', '48', 'xla'],
  ]
  for row in got:
    assert re.fullmatch(r'\d+\.\d{3}', row[3]) and float(row[4]) > 0 and re.fullmatch(r'\d+\.\d\d', row[5]), row
    assert float(row[6]) < 1e-5 and re.fullmatch(r'\d+\.\d\dx', row[7]), row
  assert got[1][7] == '1.00x'


def test_bytes_read_are_the_latents_and_k_rope_once():
  # bench_decode.md's all-MLA cache at 131072: 16 sequences x 512 latent dims in bf16 per layer
  assert bench_mla_decode.bytes_read(16, 131072, 512, 0, 2) == 16 * 131072 * 1024
  assert bench_mla_decode.bytes_read(2, 10, 64, 16, 4) == 2 * 10 * 80 * 4


def test_bad_flags_are_named():
  err = bench_mla_decode.flag_error
  assert err(['4096'], ['64', '0'], '', None, 16) is None
  assert err(['4k'], ['64'], '', None, 16) == "--contexts: ['4k'] are not whole numbers"
  assert err(['4096'], ['x'], '', None, 16) == "--rope_dims: ['x'] are not whole numbers"
  assert err(['0'], ['64'], '', None, 16) == '--contexts=0: every context must be >= 1'
  assert err(['64'], ['64'], '', 'int8', 16).startswith("--dtype='int8' is not one of")
  assert err(['64'], ['64'], '', None, 0) == '--copy_mib=0 must be >= 1'
  assert err(['64'], ['64'], 'block_z=4', None, 16).startswith("--tiles='block_z=4': ")
