"""MLA decoding over the cached latents (kimijax/ops/mla_decode.py): 'xla' and 'pallas' (the split-context
kernel, interpreted on the CPU) against a float64 NumPy transcription of the absorbed decode
(tests/oracles.py), with lengths that end mid-block, at a block edge and at 1, per sequence or one
for the batch; the kernel's settings; on a GPU, the kernel at a realistic shape in bf16 against
'xla' in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_rmse
from oracles import np_mla_decode

from kernels_pallas.mla_decode.settings import MlaDecodeSettings
from kimijax.ops import mla_decode as ops

B, H, R, S = 2, 4, 64, 96
SCALE = 0.125  # logits of std ~1 for unit-normal q and latents of 64 + 16 dims
# Lengths per sequence: at 1 and at the cache's end; mid-block and at a block edge (blocks of 64
# rows by default, of 16 with SMALL, whose 4 splits per sequence leave some splits empty).
LENGTHS = {'1_and_full': [1, 96], 'mid_block_and_edge': [70, 64], 'short': [33, 2]}
SMALL = MlaDecodeSettings(block_s=16, programs=8)
# float32 inputs: both implementations round each product and sum in float32 (the kernel's online
# softmax rescales its running sums once per block), about 1e-7 relative against float64; a
# position attended wrongly (one too many or too few, out of at most 96) moves the output by about
# 1/length >= 1e-2. 1e-5 sits between the two.
RTOL = 1e-5


def _inputs(seed, dr, s=S, dtype=jnp.float32, b=B, h=H, r=R):
  ks = jax.random.split(jax.random.key(seed), 4)
  q_latent = jax.random.normal(ks[0], (b, h, r), dtype)
  latent = jax.random.normal(ks[2], (b, s, r), dtype)
  if not dr:
    return q_latent, None, latent, None
  return q_latent, jax.random.normal(ks[1], (b, h, dr), dtype), latent, jax.random.normal(ks[3], (b, s, dr), dtype)


@pytest.mark.parametrize('lengths', LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize('dr', [16, 0])
@pytest.mark.parametrize(
  'impl,settings', [('xla', None), ('pallas', None), ('pallas', SMALL)], ids=['xla', 'pallas', 'pallas_small']
)
def test_matches_float64_numpy(impl, settings, dr, lengths):
  q_latent, q_rope, latent, k_rope = args = _inputs(0, dr)
  o = ops.mla_decode(*args, jnp.asarray(lengths), scale=SCALE, impl=impl, settings=settings)
  assert o.shape == (B, H, R) and o.dtype == jnp.float32
  assert rel_rmse(o, np_mla_decode(q_latent, q_rope, latent, k_rope, lengths, SCALE)) <= RTOL


@pytest.mark.parametrize('impl', ['xla', 'pallas'])
def test_one_length_for_the_batch(impl):
  """A scalar length (the layer's pos + 1) holds for every sequence."""
  args = _inputs(1, 16)
  for length in (1, 64, 81):
    o = ops.mla_decode(*args, length, scale=SCALE, impl=impl, settings=SMALL if impl == 'pallas' else None)
    assert rel_rmse(o, np_mla_decode(*args, length, SCALE)) <= RTOL, length


def test_pallas_reads_no_position_at_or_past_the_length():
  """NaN in the cache at and past each sequence's length leaves the kernel's output finite and exact."""
  q_latent, q_rope, latent, k_rope = _inputs(2, 16)
  lengths = np.array([37, 80])
  past = (np.arange(S)[None, :] >= lengths[:, None])[:, :, None]
  latent_nan, k_rope_nan = (jnp.where(past, jnp.nan, x) for x in (latent, k_rope))
  for settings in (None, SMALL):
    o = ops.mla_decode(q_latent, q_rope, latent_nan, k_rope_nan, lengths, scale=SCALE, impl='pallas', settings=settings)
    assert rel_rmse(o, np_mla_decode(q_latent, q_rope, latent, k_rope, lengths, SCALE)) <= RTOL


def test_more_heads_than_a_program_takes():
  """H = 24 with 16 heads per program: two head blocks, the second padded."""
  args = _inputs(3, 16, h=24, s=40)
  o = ops.mla_decode(*args, jnp.asarray([40, 17]), scale=SCALE, impl='pallas', settings=SMALL)
  assert rel_rmse(o, np_mla_decode(*args, [40, 17], SCALE)) <= RTOL


def test_settings():
  s = MlaDecodeSettings.from_string('block_s=32/warps=8')
  assert (s.block_s, s.warps, s.programs) == (32, 8, MlaDecodeSettings().programs)
  with pytest.raises(ValueError, match='mla_decode pallas: block_s must be a power of two >= 16, got 48'):
    MlaDecodeSettings(block_s=48)
  with pytest.raises(ValueError, match='heads must be a power of two >= 16, got 8'):
    MlaDecodeSettings(heads=8)
  with pytest.raises(ValueError, match=r"unknown keys \['splits'\]"):
    MlaDecodeSettings.from_string('splits=4')
  d = MlaDecodeSettings()
  assert d.splits(16, 1, 131072) == 16  # 256 of 264 programs: one wave
  assert d.splits(1, 1, 131072) == 264 and d.splits(1, 1, 100) == 2  # at most one per block of rows
  assert d.splits(512, 1, 4096) == 1


def test_bad_arguments_name_what_is_wrong():
  q_latent, q_rope, latent, k_rope = _inputs(4, 16)
  with pytest.raises(ValueError, match=r"mla_decode impl='flash' is unknown; allowed: \('xla', 'pallas'\)"):
    ops.mla_decode(q_latent, q_rope, latent, k_rope, 3, scale=SCALE, impl='flash')
  with pytest.raises(ValueError, match='both given'):
    ops.mla_decode(q_latent, q_rope, latent, None, 3, scale=SCALE)
  with pytest.raises(ValueError, match=r'q_latent must be \[B, H, r\] and latent \[B, S, r\]'):
    ops.mla_decode(q_latent, q_rope, latent[..., :32], k_rope, 3, scale=SCALE)
  with pytest.raises(ValueError, match=r'q_rope must be \[B, H, dr\] and k_rope \[B, S, dr\]'):
    ops.mla_decode(q_latent, q_rope, latent, k_rope[..., :8], 3, scale=SCALE)
  narrow = _inputs(4, 8, r=48)
  with pytest.raises(
    ValueError, match=r"impl='pallas' needs r and dr \(when not 0\) powers of two >= 16; got r 48, dr 8"
  ):
    ops.mla_decode(*narrow, 3, scale=SCALE, impl='pallas')
  assert ops.mla_decode(*narrow, 3, scale=SCALE).shape == (B, H, 48)  # 'xla' takes any dims
  assert set(ops.IMPLS) == {'xla', 'pallas'}


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize('dr', [64, 0])
def test_pallas_bf16_matches_xla_in_float32(dr):
  """bench_mla_decode's shape at 8192 positions, lengths per sequence from 1 to the whole cache.
  The kernel rounds the probabilities to bf16 for its second dot and its output to bf16 (2^-9
  relative each), against 'xla' over the same bf16 inputs in float32 at the highest precision."""
  b, s = 16, 8192
  q_latent, q_rope, latent, k_rope = args = _inputs(5, dr, s=s, dtype=jnp.bfloat16, b=b, h=8, r=512)
  lengths = jnp.asarray(np.r_[1, s, 64, 4095, np.random.default_rng(0).integers(1, s + 1, b - 4)])
  o = ops.mla_decode(*args, lengths, scale=(128 + 64) ** -0.5, impl='pallas')
  assert o.dtype == jnp.bfloat16
  f32 = [None if x is None else x.astype(jnp.float32) for x in args]
  with jax.default_matmul_precision('highest'):
    ref = ops.mla_decode(*f32, lengths, scale=(128 + 64) ** -0.5, impl='xla')
  assert rel_rmse(o.astype(jnp.float32), np.asarray(ref, np.float64)) <= 5e-3
