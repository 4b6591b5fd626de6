"""The MoE grouped-matmul Pallas kernels (kernels_pallas/moe/) interpreted on the CPU against
float64 NumPy transcriptions over the padded layout of kimijax/ops/moe.py (tiles of 16 rows, an
expert with no rows, trailing tiles past the last expert holding nonzero rows that must be
ignored), their settings, and the Triton lowering of each for an H200. The op is tested against the
float64 oracle in tests/ops/test_moe_ops.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas.moe.grouped import expert_weight_grad, gate_up_swiglu, tile_matmul
from kernels_pallas.moe.settings import MoeSettings, MosaicMoeSettings
from kimijax.ops import moe

SETTINGS = MoeSettings(block_m=16, block_n=16, block_k=16)
SIZES = (23, 0, 40, 9)  # E = 4 experts, the second with no row: 2 + 3 + 1 tiles, then 3 trailing ones


def _layout(sizes=SIZES, b=16):
  """The expert of each tile [tiles] (E past the last expert) and each slot's expert or -1 (padding)."""
  sizes_g = jnp.asarray(sizes, jnp.int32)
  layout = moe._blocked_layout(sum(sizes), sizes_g, b)
  expert_t = np.asarray(layout.group_b)
  src_p = np.asarray(layout.src_p)
  owner_p = np.where(src_p < sum(sizes), np.repeat(expert_t, b), -1)
  return expert_t, owner_p


def _slot_rows(rng, owner_p, cols, trailing_value=1.0):
  """[slots, cols] float32: random rows in the experts' slots, zero in padding slots of an expert's
  last tile, `trailing_value` in the trailing tiles' slots (rows a kernel must not read)."""
  rows = rng.standard_normal((owner_p.shape[0], cols))
  expert_p = np.repeat(_layout()[0], 16)
  rows = np.where((owner_p >= 0)[:, None], rows, 0.0)
  rows = np.where((expert_p >= len(SIZES))[:, None], trailing_value, rows)
  return jnp.asarray(rows, jnp.float32)


def test_layout_has_an_empty_expert_and_trailing_tiles():
  expert_t, owner_p = _layout()
  assert list(expert_t) == [0, 0, 2, 2, 2, 3] + [4] * 3
  assert np.sum(owner_p >= 0) == sum(SIZES)


@pytest.mark.parametrize('transpose', [False, True])
def test_tile_matmul_matches_float64(transpose):
  rng = np.random.default_rng(0)
  expert_t, owner_p = _layout()
  k, n, e = 32, 48, len(SIZES)
  a = _slot_rows(rng, owner_p, k)
  w = jnp.asarray(rng.standard_normal((e, n, k) if transpose else (e, k, n)), jnp.float32)
  out_dtype = jnp.float32 if transpose else None
  got = tile_matmul(
    a, w, jnp.asarray(expert_t), transpose=transpose, out_dtype=out_dtype, settings=SETTINGS, interpret=True
  )
  a64, w64 = np.asarray(a, np.float64), np.asarray(w, np.float64)
  w64 = np.swapaxes(w64, 1, 2) if transpose else w64
  expert_p = np.repeat(expert_t, 16)
  want = np.stack([a64[p] @ w64[q] if q < e else np.zeros(n) for p, q in enumerate(expert_p)])
  assert got.shape == (a.shape[0], n) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got)[expert_p == e])  # trailing tiles are zero whatever their rows hold


def test_tile_matmul_keeps_the_dtype_of_its_rows():
  rng = np.random.default_rng(1)
  expert_t, owner_p = _layout()
  a = _slot_rows(rng, owner_p, 16).astype(jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((4, 16, 32)), jnp.bfloat16)
  got = tile_matmul(a, w, jnp.asarray(expert_t), settings=SETTINGS, interpret=True)
  expert_p = np.repeat(expert_t, 16)
  a64, w64 = np.asarray(a, np.float64), np.asarray(w, np.float64)
  want = np.stack([a64[p] @ w64[q] if q < 4 else np.zeros(32) for p, q in enumerate(expert_p)])
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_gate_up_swiglu_matches_float64():
  """gate|up [slots, 2F] and h = silu(gate) * up [slots, F]; D = 48 runs three contraction chunks
  of 16 and F = 32 two output tiles of 16."""
  rng = np.random.default_rng(2)
  expert_t, owner_p = _layout()
  d, f, e = 48, 32, len(SIZES)
  x = _slot_rows(rng, owner_p, d)
  w_in = jnp.asarray(rng.standard_normal((e, d, 2 * f)) * d**-0.5, jnp.float32)
  gate_up, h = gate_up_swiglu(x, w_in, jnp.asarray(expert_t), settings=SETTINGS, interpret=True)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w_in, np.float64)
  expert_p = np.repeat(expert_t, 16)
  want = np.stack([x64[p] @ w64[q] if q < e else np.zeros(2 * f) for p, q in enumerate(expert_p)])
  gate, up = want[:, :f], want[:, f:]
  want_h = gate / (1 + np.exp(-gate)) * up
  assert gate_up.shape == (x.shape[0], 2 * f) and h.shape == (x.shape[0], f)
  np.testing.assert_allclose(gate_up, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(h, want_h, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(gate_up)[expert_p == e]) and not np.any(np.asarray(h)[expert_p == e])


def test_expert_weight_grad_matches_float64():
  """Each expert's sum of a_tile^T b_tile over its tiles (expert 2 has three); zero for the expert
  with no row; the trailing tiles' rows (nonzero here) reach nothing."""
  rng = np.random.default_rng(3)
  expert_t, owner_p = _layout()
  k, n, e = 32, 48, len(SIZES)
  a, b = _slot_rows(rng, owner_p, k), _slot_rows(rng, owner_p, n)
  got = expert_weight_grad(a, b, jnp.asarray(expert_t), num_experts=e, settings=SETTINGS, interpret=True)
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  expert_p = np.repeat(expert_t, 16)
  want = np.stack([a64[expert_p == q].T @ b64[expert_p == q] for q in range(e)])
  assert got.shape == (e, k, n) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert not np.any(np.asarray(got)[1])


def test_settings_are_checked():
  s = MoeSettings.from_string('block_m=64/warps=8')
  assert (s.block_m, s.warps, s.block_n) == (64, 8, 128) and hash(s) == hash(MoeSettings(block_m=64, warps=8))
  with pytest.raises(ValueError, match='moe pallas: block_k must be a power of two >= 16, got 24'):
    MoeSettings(block_k=24)
  with pytest.raises(ValueError, match=r"moe pallas: unknown keys \['block'\]"):
    MoeSettings.from_string('block=32')
  x, w = jnp.zeros((4, 16)), jnp.zeros((4, 1))
  wg, wd = jnp.zeros((2, 16, 16)), jnp.zeros((2, 16, 16))
  with pytest.raises(TypeError, match='settings must be a MoeSettings'):
    moe.routed_experts(x, w, jnp.zeros((4, 1), jnp.int32), wg, wg, wd, impl='pallas', settings={'block_m': 16})


def test_kernels_lower_to_triton_for_an_h200():
  """Each kernel (both forms of the tile matmul) goes through the Pallas Triton lowering for an H200
  here, in bf16 at the default tiles, with D = 256 and F = 192 (output tiles of 64 where 128 does
  not divide)."""
  from experiments.tools.triton_report import lower_for_h200

  s, d, f, e = 1024, 256, 192, 4
  bf16, sds = jnp.bfloat16, jax.ShapeDtypeStruct
  expert_t = sds((s // MoeSettings().block_m,), jnp.int32)
  cases = [
    ('moe_tile_matmul', lambda a, w, t: tile_matmul(a, w, t, settings=MoeSettings()), (s, d), (e, d, f)),
    (
      'moe_tile_matmul',
      lambda a, w, t: tile_matmul(a, w, t, transpose=True, out_dtype=jnp.float32, settings=MoeSettings()),
      (s, d),
      (e, f, d),
    ),
    ('moe_gate_up_swiglu', lambda a, w, t: gate_up_swiglu(a, w, t, settings=MoeSettings()), (s, d), (e, d, 2 * f)),
    (
      'moe_expert_weight_grad',
      lambda a, b, t: expert_weight_grad(a, b, t, num_experts=e, settings=MoeSettings()),
      (s, d),
      (s, 2 * f),
    ),
  ]
  for name, fn, a_shape, b_shape in cases:
    assert name in lower_for_h200(fn, sds(a_shape, bf16), sds(b_shape, bf16), expert_t), name


# ----------------------------------------------------------------------------- Mosaic GPU (grouped_mosaic.py)

MOSAIC = MosaicMoeSettings(block_m=64, block_n=64, block_k=64, block_f=64, stages=2)
MOSAIC_SIZES = (90, 0, 150, 20)  # 2 + 0 + 3 + 1 tiles of 64 rows, then 3 trailing ones


def _mosaic_rows(rng, owner_p, expert_p, cols):
  """[slots, cols] bf16: random rows in the experts' slots, zero in padding slots of an expert's
  last tile, ones in the trailing tiles (rows the kernels must not read)."""
  rows = np.where((owner_p >= 0)[:, None], rng.standard_normal((owner_p.shape[0], cols)), 0.0)
  rows = np.where((expert_p >= len(MOSAIC_SIZES))[:, None], 1.0, rows)
  return jnp.asarray(rows, jnp.bfloat16)


@pytest.mark.parametrize('consumers', [1, 2])
def test_mosaic_kernels_match_float64(consumers):
  """The Mosaic GPU kernels in Mosaic GPU's interpret mode, bf16 operands, against float64 on the
  same bf16 values: both forms of the tile matmul, gate|up with h, the down projection's input
  gradient fused with SwiGLU's backward, and the weight gradient
  (relative error of bf16 rounding for bf16 outputs, 1e-5 for the float32 ones); trailing tiles
  come out zero whatever their rows hold, and the expert with no row gets a zero gradient. K = 128
  runs two pipeline steps; N = F = 128 are two tiles of 64, one program's two consumer warpgroups
  with consumers=2."""
  from kernels_pallas.moe import grouped_mosaic as mosaic

  rng = np.random.default_rng(5)
  expert_t, owner_p = _layout(MOSAIC_SIZES, 64)
  expert_p, e = np.repeat(expert_t, 64), len(MOSAIC_SIZES)
  trailing = expert_p == e
  k, n, f = 128, 128, 128
  a = _mosaic_rows(rng, owner_p, expert_p, k)
  b = _mosaic_rows(rng, owner_p, expert_p, n)
  w = jnp.asarray(rng.standard_normal((e, k, n)) * k**-0.5, jnp.bfloat16)
  w_in = jnp.asarray(rng.standard_normal((e, k, 2 * f)) * k**-0.5, jnp.bfloat16)
  a64, b64, w64, w_in64 = (np.asarray(v, np.float64) for v in (a, b, w, w_in))
  run = dict(settings=MOSAIC.replace(consumers=consumers), interpret=True)
  tiles = jnp.asarray(expert_t)

  def per_slot(x64, mats, cols):
    return np.stack([x64[p] @ mats[q] if q < e else np.zeros(cols) for p, q in enumerate(expert_p)])

  def close(got, want, tol):
    got = np.asarray(got, np.float64)
    assert np.max(np.abs(got - want)) <= tol * np.max(np.abs(want))
    assert not np.any(got[trailing])

  close(mosaic.tile_matmul(a, w, tiles, **run), per_slot(a64, w64, n), 1e-2)
  got_t = mosaic.tile_matmul(b, w, tiles, transpose=True, out_dtype=jnp.float32, **run)  # b @ w[e]^T
  assert got_t.dtype == jnp.float32
  close(got_t, per_slot(b64, w64.transpose(0, 2, 1), k), 1e-5)
  gate_up, h = mosaic.gate_up_swiglu(a, w_in, tiles, **run)
  want = per_slot(a64, w_in64, 2 * f)
  close(gate_up, want, 1e-2)
  gate, up = (np.asarray(v, np.float64) for v in (gate_up[:, :f], gate_up[:, f:]))
  close(h, gate / (1 + np.exp(-gate)) * up, 1e-2)  # from the rounded gate and up
  # the down projection's input gradient fused with SwiGLU's backward (dh = w u, u = b W_down^T)
  w_down = jnp.asarray(rng.standard_normal((e, f, n)) * n**-0.5, jnp.bfloat16)
  w_p = jnp.asarray(np.where(owner_p >= 0, rng.random(owner_p.shape[0]), 0.0), jnp.float32)
  d_gate_up, wh, uh = mosaic.down_swiglu_backward(b, w_down, gate_up, w_p, tiles, **run)
  u = per_slot(b64, np.asarray(w_down, np.float64).transpose(0, 2, 1), f)
  w64 = np.asarray(w_p, np.float64)[:, None]
  sig = 1 / (1 + np.exp(-gate))
  want_d = np.concatenate([w64 * u * up * sig * (1 + gate * (1 - sig)), w64 * u * gate * sig], axis=1)
  close(d_gate_up, want_d, 1e-2)
  close(wh, w64 * gate * sig * up, 1e-2)
  close(uh, np.sum(u * gate * sig * up, axis=1), 1e-5)
  got_w = np.asarray(mosaic.expert_weight_grad(a, b, tiles, num_experts=e, **run), np.float64)
  want_w = np.stack([a64[expert_p == q].T @ b64[expert_p == q] for q in range(e)])
  assert got_w.shape == (e, k, n) and np.max(np.abs(got_w - want_w)) <= 1e-5 * np.max(np.abs(want_w))
  assert not np.any(got_w[1])


def test_mosaic_settings_are_checked():
  assert MosaicMoeSettings.from_string('block_f=128/stages=3') == MosaicMoeSettings(block_f=128, stages=3)
  with pytest.raises(ValueError, match='moe mosaic: block_m must be a multiple of 64, got 32'):
    MosaicMoeSettings(block_m=32)
  from kernels_pallas.moe import grouped_mosaic as mosaic

  with pytest.raises(ValueError, match='moe mosaic: block_f must be a power of two >= 64, got 96'):
    MosaicMoeSettings(block_f=96)
  with pytest.raises(ValueError, match='moe mosaic: consumers must be 1 or 2, got 3'):
    MosaicMoeSettings(consumers=3)
  with pytest.raises(ValueError, match=r'moe mosaic: the contraction dim \(96\) must be a multiple of 64'):
    mosaic.tile_matmul(
      jnp.zeros((128, 96), jnp.bfloat16), jnp.zeros((1, 96, 64), jnp.bfloat16), jnp.zeros(1), settings=MOSAIC
    )
  with pytest.raises(ValueError, match='moe mosaic: operands must be bfloat16 or float16'):
    mosaic.tile_matmul(jnp.zeros((128, 64)), jnp.zeros((1, 64, 64)), jnp.zeros(1), settings=MOSAIC)
  assert [mosaic._fitting_stages(4, b) for b in (32768, 65536, 200_000)] == [4, 3, 2]  # 227 KB of shared memory
  # two consumers of gate_up_swiglu: 3 bf16 [128, 64] output tiles each beside 48 KB a stage
  assert mosaic._fitting_stages(3, 48 * 1024, mosaic.SMEM_BYTES - 2 * 3 * 128 * 64 * 2) == 2
  big = jax.ShapeDtypeStruct((64 * 65536, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r'65536 tiles of block_m=64, more than a grid holds \(65535\)'):
    jax.eval_shape(
      lambda a: mosaic.tile_matmul(a, jnp.zeros((1, 64, 64), jnp.bfloat16), jnp.zeros(65536), settings=MOSAIC), big
    )
