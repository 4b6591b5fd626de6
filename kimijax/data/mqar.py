"""Synthetic multi-query associative recall (MQAR, as in Zoology).

Layout of one row (T+1 tokens, then inputs = row[:-1], targets = row[1:]):

  k1 v1 k2 v2 ... kP vP | query region of 2-token slots
                          each slot is PAD PAD, or a query `k v` of an earlier
                          pair; every key is queried exactly once, in random
                          order, in randomly chosen slots.

Keys come from ids [0, R), values from [R, 2R) with R = (vocab_size - 2) // 2
(for the byte vocab 258: keys 0..127, values 128..255, filler PAD = 257).
mask = 1 exactly at input positions holding a query key, whose target is the
paired value that must be recalled.
"""

from __future__ import annotations

import numpy as np

from kimijax.data.sources import DataError


def mqar_layout(seq_len: int, num_pairs: int, vocab_size: int) -> tuple[int, int]:
  """Validates the setting; returns (id range size R, number of query slots)."""
  id_range = (vocab_size - 2) // 2
  if num_pairs < 1 or num_pairs > id_range:
    raise DataError(
      f'data.mqar_num_pairs={num_pairs} must be in [1, {id_range}] (keys are distinct ids drawn from {id_range} values)'
    )
  num_slots = (seq_len + 1 - 2 * num_pairs) // 2
  if num_slots < num_pairs:
    raise DataError(
      f'train.seq_len={seq_len} is too short for data.mqar_num_pairs='
      f'{num_pairs}: need seq_len >= 4 * num_pairs - 1 = {4 * num_pairs - 1}'
      f' ({num_pairs} key-value pairs plus {num_pairs} queries)'
    )
  return id_range, num_slots


def _random_subsets(rng: np.random.Generator, n: int, k: int, batch: int):
  """[batch, k] int64: k distinct values of range(n) per row, random order."""
  return np.argsort(rng.random((batch, n)), axis=1)[:, :k]


def mqar_batch(
  rng: np.random.Generator,
  batch_size: int,
  seq_len: int,
  *,
  num_pairs: int,
  vocab_size: int,
) -> dict[str, np.ndarray]:
  """Returns inputs/targets [B, T] int32 and mask [B, T] float32 (see module doc)."""
  id_range, num_slots = mqar_layout(seq_len, num_pairs, vocab_size)
  pad_id = vocab_size - 1
  b, p = batch_size, num_pairs
  rows = np.arange(b)[:, None]

  keys = _random_subsets(rng, id_range, p, b)  # distinct per row
  values = rng.integers(id_range, 2 * id_range, size=(b, p))  # may repeat
  seq = np.full((b, seq_len + 1), pad_id, dtype=np.int32)
  seq[:, 0 : 2 * p : 2] = keys
  seq[:, 1 : 2 * p : 2] = values

  order = _random_subsets(rng, p, p, b)  # which pair to ask
  slots = np.sort(_random_subsets(rng, num_slots, p, b), axis=1)
  key_pos = 2 * p + 2 * slots
  seq[rows, key_pos] = keys[rows, order]
  seq[rows, key_pos + 1] = values[rows, order]

  mask = np.zeros((b, seq_len), dtype=np.float32)
  mask[rows, key_pos] = 1.0
  return {'inputs': seq[:, :-1], 'targets': seq[:, 1:], 'mask': mask}
