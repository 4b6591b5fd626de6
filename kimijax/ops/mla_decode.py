"""MLA decoding in the absorbed form over the cached latents (docs/attention.md#decoding): the op
and its implementations.

    o_latent = mla_decode(q_latent, q_rope, latent, k_rope, length, *, scale, impl='xla', settings=None)

q_latent [B, H, r] are the queries mapped into the latent space (W_uk_h^T q_nope_h), q_rope [B, H, dr]
their decoupled part (None when dr = 0), latent [B, S, r] and k_rope [B, S, dr] (None when dr = 0) the
cache, length int [B] or a scalar: each sequence attends to its positions < length (1 <= length <= S).
The logits scale (q_latent . latent + q_rope . k_rope) are float32, the softmax over the attended
positions too, and o_latent [B, H, r] = softmax @ latent comes back in latent's dtype; the caller
maps it out with W_uv. IMPLS holds the implementations by name:

- 'xla': einsums over all S positions of the cache, the ones at or past the length masked: XLA reads
  the latents twice (logits, then o), the whole cache whatever the length;
- 'pallas': kernels_pallas/mla_decode (flash-decoding: one kernel split over the context reads
  each latent up to the length once, a small XLA combine merges the splits; interpreted off the
  GPU, for tests; its Triton settings as `settings=`, an MlaDecodeSettings, None the defaults).
  r and dr (when not 0) powers of two >= 16.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp

from kimijax.ops.attention import MASKED_LOGIT


def _xla(q_latent, q_rope, latent, k_rope, length, *, scale, settings):
  del settings  # no kernels
  logits = jnp.einsum('bhr,bsr->bhs', q_latent, latent, preferred_element_type=jnp.float32)
  if q_rope is not None:
    logits += jnp.einsum('bhk,bsk->bhs', q_rope, k_rope, preferred_element_type=jnp.float32)
  allowed = jnp.arange(latent.shape[1])[None, None, :] < length[:, None, None]
  probs = jax.nn.softmax(jnp.where(allowed, logits * scale, MASKED_LOGIT), axis=-1)
  return jnp.einsum('bhs,bsr->bhr', probs.astype(latent.dtype), latent)


def _pallas(q_latent, q_rope, latent, k_rope, length, *, scale, settings):
  from kernels_pallas.common import kernels_interpreted
  from kernels_pallas.mla_decode import mla_decode_pallas

  return mla_decode_pallas(
    q_latent, q_rope, latent, k_rope, length, scale=scale, settings=settings, interpret=kernels_interpreted()
  )


def _pallas_settings(text: str):
  from kernels_pallas.mla_decode.settings import MlaDecodeSettings

  return MlaDecodeSettings.from_string(text)


def pallas_dims_problem(kv_lora_rank: int, rope_dim: int) -> str | None:
  """Why 'pallas' cannot take latents of rank r = kv_lora_rank and dr = rope_dim decoupled dims, or None:
  its dots and blocks need r, and dr when not 0, powers of two >= 16."""
  bad = [f'{name} {d}' for name, d in (('r', kv_lora_rank), ('dr', rope_dim)) if d and (d < 16 or d & (d - 1))]
  if kv_lora_rank == 0:
    bad.insert(0, 'r 0')
  return f'needs r and dr (when not 0) powers of two >= 16; got {", ".join(bad)}' if bad else None


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of MLA decoding. decode: (q_latent, q_rope, latent, k_rope, length [B] int32,
  keywords scale, settings) -> o_latent (kernels run interpreted off an NVIDIA GPU, as the KDA and
  short-convolution kernels do). dims_problem: (r, dr) -> why it cannot take those dims, or None.
  parse_settings: 'key=int/key=int' -> the settings its kernels take (None: it has no kernels and
  ignores the settings argument)."""

  decode: Callable
  dims_problem: Callable[[int, int], str | None] = lambda r, dr: None
  parse_settings: Callable[[str], object] | None = None


IMPLS = types.MappingProxyType(
  {
    'xla': Implementation(_xla),
    'pallas': Implementation(_pallas, dims_problem=pallas_dims_problem, parse_settings=_pallas_settings),
  }
)


def mla_decode(q_latent, q_rope, latent, k_rope, length, *, scale: float, impl: str = 'xla', settings=None):
  """o_latent [B, H, r] in latent's dtype (the module docstring). impl: a key of IMPLS ('xla' | 'pallas');
  settings: the kernels' settings of an implementation that has them (None: their defaults)."""
  if impl not in IMPLS:
    raise ValueError(f'mla_decode impl={impl!r} is unknown; allowed: {tuple(IMPLS)}')
  if q_latent.ndim != 3 or latent.ndim != 3 or latent.shape[::2] != q_latent.shape[::2]:
    raise ValueError(
      f'mla_decode: q_latent must be [B, H, r] and latent [B, S, r]; got {list(q_latent.shape)}, {list(latent.shape)}'
    )
  if (q_rope is None) != (k_rope is None):
    raise ValueError('mla_decode: q_rope and k_rope are both given (dr > 0) or both None (dr = 0)')
  if q_rope is not None and (
    q_rope.shape[:2] != q_latent.shape[:2] or k_rope.shape[:2] != latent.shape[:2] or q_rope.shape[2] != k_rope.shape[2]
  ):
    raise ValueError(
      f'mla_decode: q_rope must be [B, H, dr] and k_rope [B, S, dr] beside q_latent {list(q_latent.shape)} and '
      f'latent {list(latent.shape)}; got {list(q_rope.shape)}, {list(k_rope.shape)}'
    )
  problem = IMPLS[impl].dims_problem(latent.shape[2], 0 if k_rope is None else k_rope.shape[2])
  if problem:
    raise ValueError(f'mla_decode impl={impl!r} {problem}')
  length = jnp.broadcast_to(jnp.asarray(length, jnp.int32), (q_latent.shape[0],))
  return IMPLS[impl].decode(q_latent, q_rope, latent, k_rope, length, scale=scale, settings=settings)
