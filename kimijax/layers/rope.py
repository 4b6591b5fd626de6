"""Rotary position embedding, optionally with YaRN's context extension (docs/attention.md#yarn).

    x_bthd = apply_rope(x_bthd, positions_bt, theta)                        # RoPE
    x_bthd = apply_rope(x_bthd, positions_bt, theta, Yarn(40.0, 4096, mscale=1.0, mscale_all_dim=1.0))

Dims i and i + D/2 rotate together by position * inv_freq_i, inv_freq_i = theta ** (-2i / D).

YaRN (Peng et al. 2023, arXiv:2309.00071), as DeepSeek-V3 and Kimi K2 extend their context from
`original_context` tokens by `factor`: a frequency whose wavelength fits many times into the
original context (more than beta_fast turns) is kept, one that turns fewer than beta_slow times is
divided by `factor` (position interpolation), and those between are blended along a linear ramp
over the dim index. The rotated dims are then scaled by an attention factor, and the softmax scale
by a multiplier:

    m(s, k) = 0.1 k ln(s) + 1 for s > 1, else 1
    attention factor   = m(factor, mscale) / m(factor, mscale_all_dim)  with both set, else m(factor, 1)
    softmax multiplier = m(factor, mscale_all_dim) ** 2                 with mscale_all_dim set, else 1

(DeepSeek-V3 and K2 set mscale = mscale_all_dim = 1: no attention factor, the softmax scale times
m(factor, 1)^2.)
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Yarn:
  factor: float
  original_context: int
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 0.0  # 0: unset
  mscale_all_dim: float = 0.0  # 0: unset

  def inv_freq(self, d: int, theta: float) -> np.ndarray:
    """float32 [d / 2]: the blend of the kept and the interpolated frequencies."""
    kept = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)

    def dim_of(turns):  # the dim index whose wavelength fits `turns` times into the original context
      return d * math.log(self.original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(dim_of(self.beta_fast)), 0), min(math.ceil(dim_of(self.beta_slow)), d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / ((high - low) or 0.001), 0.0, 1.0)  # 0: kept, 1: interpolated
    return (kept / self.factor * ramp + kept * (1 - ramp)).astype(np.float32)

  def attention_factor(self) -> float:
    if self.mscale and self.mscale_all_dim:
      return _m(self.factor, self.mscale) / _m(self.factor, self.mscale_all_dim)
    return _m(self.factor, 1.0)

  def softmax_multiplier(self) -> float:
    return _m(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def _m(scale: float, k: float) -> float:
  return 0.1 * k * math.log(scale) + 1.0 if scale > 1 else 1.0


def softmax_scale(head_dim: int, yarn: Yarn | None) -> float:
  """head_dim ** -0.5, times YaRN's softmax multiplier."""
  return head_dim**-0.5 * (yarn.softmax_multiplier() if yarn else 1.0)


def apply_rope(x_bthd, positions_bt, theta: float, yarn: Yarn | None = None):
  """Rotary embedding (rotate-half pairing of dims i and i + D/2), computed in float32."""
  d = x_bthd.shape[-1]
  if yarn is None:
    inv_freq, factor = theta ** (-jnp.arange(0, d // 2, dtype=jnp.float32) * 2.0 / d), 1.0
  else:
    inv_freq, factor = jnp.asarray(yarn.inv_freq(d, theta)), yarn.attention_factor()
  angles = positions_bt.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, D/2]
  sin, cos = jnp.sin(angles) * factor, jnp.cos(angles) * factor
  x = x_bthd.astype(jnp.float32)
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_bthd.dtype)
