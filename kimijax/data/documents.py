"""Document boundaries of packed rows: segment ids and positions (data.document_mask).

A packed token stream separates documents by EOS: `d1 EOS d2 EOS d3 ...`. In a row of inputs, a
segment starts at the row's first token and at every EOS after it: the EOS that ends document d
opens the segment of document d + 1, in the place a BOS takes. So every target is predicted from
its own document only: the last token of d predicts the EOS inside d's segment, and the EOS, alone
at position 0 of the next segment, predicts the next document's first token. A row that starts
inside a document has that document's tail as its first segment.

  segment_ids [B, T] int32: 1, 2, 3, ... in row order, one per segment (0 is kept for padding;
                            packed rows have none)
  positions   [B, T] int32: the index of the token within its segment (0 at the segment's first
                            token: a row's first token or an EOS)
"""

from __future__ import annotations

import numpy as np


def document_ids(inputs_bt: np.ndarray, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment_ids, positions), each int32 [B, T], of packed input rows (module docstring)."""
  inputs_bt = np.asarray(inputs_bt)
  b, t = inputs_bt.shape
  opens = inputs_bt == eos_id
  opens[:, 0] = True
  segment_ids = np.cumsum(opens, axis=1, dtype=np.int32)
  flat = np.arange(b * t, dtype=np.int32)
  # Each row opens a segment at its first token, so one running maximum over the flattened rows
  # gives every token's segment start.
  starts = np.maximum.accumulate(np.where(opens.reshape(-1), flat, 0))
  return segment_ids, (flat - starts).reshape(b, t)


def single_document(batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """(segment_ids, positions) of rows that each hold one document: all ones, and 0..T-1."""
  segment_ids = np.ones((batch_size, seq_len), dtype=np.int32)
  positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (batch_size, seq_len)).copy()
  return segment_ids, positions


def random_documents(batch_size: int, seq_len: int, low: int, high: int, seed: int = 0):
  """(segment_ids, positions), each int32 [B, T], of rows packed with documents of lengths drawn
  uniformly from [low, high) (the benchmarks' stand-in for a corpus, experiments/bench/bench_train.py):
  a row starts inside a document (its tail, of a length drawn from [1, high)) and its last document
  is cut by the row's end."""
  if not 1 <= low < high:
    raise ValueError(f'document lengths: need 1 <= low < high, got [{low}, {high})')
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch_size):
    lengths = [int(rng.integers(1, high))]
    while sum(lengths) < seq_len:
      lengths.append(int(rng.integers(low, high)))
    lengths[-1] -= sum(lengths) - seq_len
    rows.append(lengths)
  segment_ids = np.stack([np.repeat(np.arange(1, len(r) + 1, dtype=np.int32), r) for r in rows])
  positions = np.stack([np.concatenate([np.arange(n, dtype=np.int32) for n in r]) for r in rows])
  return segment_ids, positions
