"""MLA decoding over the compressed latents (docs/attention.md#decoding) as one Pallas (Triton)
kernel, split over the context (flash-decoding), and its combine in XLA.

    o_latent = mla_decode_pallas(q_latent, q_rope, latent, k_rope, length, scale=..., settings=..., interpret=...)

q_latent [B, H, r] (the absorbed queries W_uk^T q_nope), q_rope [B, H, dr] or None, latent [B, S, r]
and k_rope [B, S, dr] or None (the cache), length int32 [B] (the positions < length are attended):

    logits[h, s] = scale (q_latent[h] . latent[s] + q_rope[h] . k_rope[s]),  s < length
    o_latent[h] = softmax_s(logits[h]) @ latent

Grid (B, head blocks, splits). Each program takes its sequence's positions [j c, (j + 1) c) with
c = ceil(length / splits) rounded up to block_s (computed in the kernel from the sequence's
length, so the splits share the positions that exist whatever the cache's size), streams those
latent (and k_rope) blocks [block_s, r] once, with the logits of all its heads from one dot
([heads, r] x [r, block_s]), an online softmax in float32 and o [heads, r] accumulated in float32;
positions at or past the length are neither loaded nor attended, and a split that starts past it
loads nothing. It writes its o, running max and running sum; `combine` merges the splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from kernels_pallas.common import compiler_params, round_up
from kernels_pallas.mla_decode.settings import MlaDecodeSettings

F32 = jnp.float32
EMPTY_MAX = -1e30  # the running max of a split with no positions (finite: its weight in combine is 0)


def _rows(ref, start, end, block_s):
  """Rows start + [0, block_s) of a cache ref [S, d], rows at or past `end` read as zero (loaded
  through clamped indices under a mask)."""
  s, d = ref.shape
  r = start + jax.lax.broadcasted_iota(jnp.int32, (block_s, 1), 0)
  idx = (jnp.clip(r, 0, s - 1), jax.lax.broadcasted_iota(jnp.int32, (1, d), 1))
  return plgpu.load(ref.at[idx], mask=jnp.broadcast_to(r < end, (block_s, d)), other=0)


def _dot_rows(x, y):
  """x [M, d] . y [N, d]^T -> [M, N] float32."""
  return jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())), preferred_element_type=F32)


def _kernel(length_ref, q_ref, *refs, scale, block_s, splits, rope):
  """refs: (q_rope_ref, latent_ref, k_rope_ref, o_ref, m_ref, l_ref), without the two rope refs when
  dr = 0."""
  if rope:
    q_rope_ref, latent_ref, k_rope_ref, o_ref, m_ref, l_ref = refs
  else:
    (latent_ref, o_ref, m_ref, l_ref), q_rope_ref, k_rope_ref = refs, None, None
  length = length_ref[0]
  chunk = pl.cdiv(pl.cdiv(length, splits), block_s) * block_s
  start = pl.program_id(2) * chunk
  end = jnp.minimum(start + chunk, length)
  q = q_ref[...]
  q_rope = q_rope_ref[...] if rope else None
  heads, r = q.shape

  def body(i, carry):
    o, m, l = carry
    s0 = start + i * block_s
    c = _rows(latent_ref, s0, end, block_s)  # [block_s, r]
    logits = _dot_rows(q, c)
    if rope:
      logits += _dot_rows(q_rope, _rows(k_rope_ref, s0, end, block_s))
    valid = (s0 + jax.lax.broadcasted_iota(jnp.int32, (1, block_s), 1)) < end
    logits = jnp.where(valid, logits * scale, EMPTY_MAX)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(logits - m_new[:, None])
    o = o * alpha[:, None] + jnp.dot(p.astype(c.dtype), c, preferred_element_type=F32)
    return o, m_new, l * alpha + jnp.sum(p, axis=1)

  n = pl.cdiv(jnp.maximum(end - start, 0), block_s)
  init = (jnp.zeros((heads, r), F32), jnp.full((heads,), EMPTY_MAX, F32), jnp.zeros((heads,), F32))
  o, m, l = jax.lax.fori_loop(0, n, body, init)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def combine(o_bjhr, m_bjh, l_bjh):
  """The splits' (o, running max, running sum) -> o [B, H, r] float32: each split's o and sum
  rescaled to the largest max, summed, o divided by the sum. Splits with no positions have max
  EMPTY_MAX and sum 0, so weight 0 (every sequence has a position: length >= 1)."""
  m_bh = jnp.max(m_bjh, axis=1)
  w_bjh = jnp.exp(m_bjh - m_bh[:, None])
  o_bhr = jnp.einsum('bjh,bjhr->bhr', w_bjh, o_bjhr, precision=jax.lax.Precision.HIGHEST)  # no TF32 on a GPU
  return o_bhr / jnp.sum(w_bjh * l_bjh, axis=1)[..., None]


def mla_decode_pallas(q_latent, q_rope, latent, k_rope, length, *, scale, settings=None, interpret=False):
  """q_latent [B, H, r], q_rope [B, H, dr] or None, latent [B, S, r], k_rope [B, S, dr] or None, length
  int32 [B] (1 <= length <= S) -> o_latent [B, H, r] in latent's dtype (the module docstring). r and
  dr powers of two >= 16; q in latent's dtype. settings: an MlaDecodeSettings (None: the defaults)."""
  settings = MlaDecodeSettings() if settings is None else settings
  if not isinstance(settings, MlaDecodeSettings):
    raise TypeError(f"mla_decode impl='pallas': settings must be an MlaDecodeSettings or None, got {type(settings)}")
  return _mla_decode_pallas(
    q_latent, q_rope, latent, k_rope, length, scale=float(scale), settings=settings, interpret=interpret
  )


@functools.partial(jax.jit, static_argnames=('scale', 'settings', 'interpret'))
def _mla_decode_pallas(q_latent, q_rope, latent, k_rope, length, *, scale, settings, interpret):
  b, h, r = q_latent.shape
  s = latent.shape[1]
  rope = q_rope is not None
  heads = min(settings.heads, max(16, pl.next_power_of_2(h)))  # the dots' rows: at least 16
  hp = round_up(h, heads)
  splits = settings.splits(b, hp // heads, s)
  pad = lambda x: jnp.pad(x.astype(latent.dtype), ((0, 0), (0, hp - h), (0, 0)))
  query = lambda d: pl.BlockSpec((None, heads, d), lambda bi, g, j: (bi, g, 0))
  cache = lambda d: pl.BlockSpec((None, s, d), lambda bi, g, j: (bi, 0, 0))
  args = [length.astype(jnp.int32)[:, None], pad(q_latent)]
  in_specs = [pl.BlockSpec((None, 1), lambda bi, g, j: (bi, 0)), query(r)]
  if rope:
    dr = q_rope.shape[-1]
    args += [pad(q_rope), latent, k_rope.astype(latent.dtype)]
    in_specs += [query(dr), cache(r), cache(dr)]
  else:
    args.append(latent)
    in_specs.append(cache(r))
  per_split = pl.BlockSpec((None, None, heads), lambda bi, g, j: (bi, j, g))
  o, m, l = pl.pallas_call(
    functools.partial(_kernel, scale=scale, block_s=settings.block_s, splits=splits, rope=rope),
    grid=(b, hp // heads, splits),
    in_specs=in_specs,
    out_specs=[pl.BlockSpec((None, None, heads, r), lambda bi, g, j: (bi, j, g, 0)), per_split, per_split],
    out_shape=[
      jax.ShapeDtypeStruct((b, splits, hp, r), F32),
      jax.ShapeDtypeStruct((b, splits, hp), F32),
      jax.ShapeDtypeStruct((b, splits, hp), F32),
    ],
    compiler_params=compiler_params(settings),
    interpret=interpret,
    name='mla_decode',
  )(*args)
  return combine(o[:, :, :h], m[:, :, :h], l[:, :, :h]).astype(latent.dtype)
