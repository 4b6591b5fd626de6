"""A Hugging Face `tokenizers` tokenizer.json behind kimijax's Tokenizer interface.

Encoding adds no special tokens (the tokenizer's post-processor, e.g. a BOS, is not applied: the
pipeline separates documents with EOS itself) and reads the text of special tokens as plain text
(`encode_special_tokens`), so the ids of a document never contain EOS. Decoding drops special ids.
The roles of EOS / BOS / PAD: kimijax/data/special_tokens.py. vocab_size is one more than the
largest id of the vocabulary and the added tokens. The fingerprint hashes the file's bytes and the
three role ids. Batches are encoded by one thread per process unless TOKENIZERS_PARALLELISM allows
more (the `tokenizers` default).
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np

from kimijax.data import special_tokens
from kimijax.data.sources import DataError
from kimijax.data.tokenizer import Tokenizer, as_text, file_sha256


class HFTokenizer(Tokenizer):
  """Tokenizer of the tokenizer.json at `path` (see the module docstring)."""

  def __init__(self, spec: str, path: str):
    from tokenizers import Tokenizer as _Tokenizer

    file = pathlib.Path(path).expanduser()
    if not file.is_file():
      raise DataError(f'data.tokenizer={spec!r}: {file} does not exist')
    try:
      tok = _Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises a plain Exception
      reason = ' '.join(str(e).split())[:200]
      raise DataError(f'data.tokenizer={spec!r}: {file} is not a tokenizers tokenizer.json ({reason})') from None
    tok.encode_special_tokens = True
    vocab = tok.get_vocab(with_added_tokens=True)
    if not vocab:
      raise DataError(f'data.tokenizer={spec!r}: {file} has an empty vocabulary')
    roles = special_tokens.special_roles(file, vocab, special_tokens.sidecar_config(file))
    self._tok = tok
    self._special = np.array(sorted(tok.get_added_tokens_decoder()), dtype=np.int64)
    self.spec = spec
    self.path = str(file)
    self.vocab_size = max(vocab.values()) + 1
    self.eos_id, self.bos_id, self.pad_id = roles['eos'], roles['bos'], roles['pad']
    self.fingerprint = hashlib.sha256(json.dumps(['hf', file_sha256(file), roles], sort_keys=True).encode()).hexdigest()

  def encode_batch(self, texts) -> list[np.ndarray]:
    encodings = self._tok.encode_batch_fast([as_text(t) for t in texts], add_special_tokens=False)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

  def decode(self, ids) -> str:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < self.vocab_size) & ~np.isin(ids, self._special)]
    return self._tok.decode(ids.tolist(), skip_special_tokens=True)
