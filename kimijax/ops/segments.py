"""Document boundaries of packed rows, as the sequence ops take them (docs/data.md#document-masking).

A packed row holds several documents, its segments: `segment_ids` [B, T] int32 gives each token
its segment's id, and each segment is one contiguous run of equal ids (the data pipeline numbers
them 1, 2, ... along the row: kimijax/data/documents.py). With segment ids, the sequence ops keep
segments apart: attention attends within the query's segment only, KDA's state restarts from
zero at each segment's first token and the short convolution reads zeros for inputs of another
segment. The row's first segment continues from whatever comes before the row (an initial state
or a conv prefix, zeros without one); every later segment starts from nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_starts(segment_ids_bt) -> jax.Array:
  """bool [B, T]: True at each token t >= 1 whose segment differs from token t - 1's (the first
  token of every segment but the row's first)."""
  ids = jnp.asarray(segment_ids_bt)
  return jnp.concatenate([jnp.zeros_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)


def segment_start_index(segment_ids_bt) -> jax.Array:
  """int32 [B, T]: the index in the row of the first token of each token's segment (0 for the
  row's first segment)."""
  starts = segment_starts(segment_ids_bt)
  t = jnp.arange(starts.shape[1], dtype=jnp.int32)
  return jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def tokens_since_start(segment_ids_bt) -> jax.Array:
  """int32 [B, T]: how many tokens of its own segment precede each token (0 at a segment's first
  token; the row's first segment counts from the row's start)."""
  index = segment_start_index(segment_ids_bt)
  return jnp.arange(index.shape[1], dtype=jnp.int32) - index
