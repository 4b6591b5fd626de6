"""Byte-level tokenizer: ids 0..255 are raw utf-8 bytes, plus two specials."""

from __future__ import annotations

import numpy as np

EOS_ID = 256  # document separator
PAD_ID = 257  # padding / filler
VOCAB_SIZE = 258


class ByteTokenizer:
  """Maps text <-> int32 ids. `vocab_size` = 258 (256 bytes + EOS + PAD)."""

  vocab_size = VOCAB_SIZE
  eos_id = EOS_ID
  pad_id = PAD_ID

  def encode(self, text: str | bytes) -> np.ndarray:
    """Returns the utf-8 bytes of `text` as an int32 array of shape [len]."""
    data = text.encode('utf-8') if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def decode(self, ids) -> str:
    """Decodes ids (any int array-like); special ids are dropped."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < 256)]
    return ids.astype(np.uint8).tobytes().decode('utf-8', errors='replace')
