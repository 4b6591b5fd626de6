"""Next-token sampling: temperature, top-k and top-p (nucleus), in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(logits_bv, *, top_k: int = 0, top_p: float = 1.0):
  """Logits with every token outside the top-k and outside the smallest set whose probability
  reaches top_p set to -inf (0 / 1.0 disable them). The most likely token always survives."""
  logits_bv = logits_bv.astype(jnp.float32)
  if top_k:
    kth = jax.lax.top_k(logits_bv, top_k)[0][:, -1:]
    logits_bv = jnp.where(logits_bv < kth, -jnp.inf, logits_bv)
  if top_p < 1.0:
    sorted_desc = jnp.sort(logits_bv, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    keep = before < top_p
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits_bv = jnp.where(logits_bv < threshold, -jnp.inf, logits_bv)
  return logits_bv


def sample(rng, logits_bv, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
  """[B, V] logits -> [B] int32 tokens; temperature 0 is greedy."""
  if temperature == 0.0:
    return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
  filtered = filter_logits(logits_bv / temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(rng, filtered, axis=-1).astype(jnp.int32)
