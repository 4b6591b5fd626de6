"""Tokenizers behind one interface, chosen by `data.tokenizer`.

Specs (the value of `data.tokenizer`):
  'byte'            ids 0..255 are raw UTF-8 bytes, EOS = 256, PAD = 257 (vocab 258); no file.
  'hf:PATH'         a Hugging Face `tokenizers` tokenizer.json (kimijax/data/tokenizer_hf.py).
  'tiktoken:PATH'   a tiktoken-format BPE file, one `base64(token) rank` per line, as OpenAI's
                    .tiktoken files and Kimi's tiktoken.model ship (kimijax/data/tokenizer_tiktoken.py);
                    'tiktoken:PATH#PRESET' names its split pattern and special tokens explicitly.

Every tokenizer has `vocab_size` (one more than its largest id), `eos_id` (the document separator:
the pipeline writes it after every document), `pad_id` (the filler of padded positions), `bos_id`
(None when the tokenizer has none; the pipeline never inserts it), `fingerprint` (a hex SHA-256 of
everything that decides the ids: shards record it and refuse another tokenizer), and
`encode(text) -> int32 [n]`, `encode_batch(texts) -> list of int32 [n_i]`, `decode(ids) -> str`
(special ids are dropped). Text arrives as `str` or UTF-8 `bytes`; the BPE tokenizers decode bytes
with errors='replace' (the byte tokenizer keeps them exactly). Encoding never emits a special id
for text that spells one (a document holding the literal text '<|endoftext|>' is not cut there), so
EOS in a token stream always marks a document boundary.

The files are read from the local disk only; nothing is downloaded. `tokenizers` and `tiktoken` are
imported only when such a spec is loaded.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

from kimijax.data.sources import DataError

EOS_ID = 256  # document separator
PAD_ID = 257  # padding / filler
VOCAB_SIZE = 258
VOCAB_MULTIPLE = 128  # model.vocab_size = 0 pads the tokenizer's vocabulary to a multiple of this


class Tokenizer:
  """The interface (see the module docstring). Subclasses set the attributes and implement
  encode_batch and decode."""

  spec: str
  vocab_size: int
  eos_id: int
  pad_id: int
  bos_id: int | None
  fingerprint: str

  def encode(self, text: str | bytes) -> np.ndarray:
    """int32 [n] ids of `text`; no special ids."""
    return self.encode_batch([text])[0]

  def encode_batch(self, texts) -> list[np.ndarray]:
    raise NotImplementedError

  def decode(self, ids) -> str:
    raise NotImplementedError

  @property
  def token_dtype(self) -> np.dtype:
    """The narrowest unsigned dtype that holds every id: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

  def describe(self) -> dict:
    """The tokenizer's record in a shard manifest."""
    return {
      'spec': self.spec,
      'fingerprint': self.fingerprint,
      'vocab_size': self.vocab_size,
      'eos_id': self.eos_id,
      'pad_id': self.pad_id,
      'bos_id': self.bos_id,
    }


class ByteTokenizer(Tokenizer):
  """Maps text <-> int32 ids. `vocab_size` = 258 (256 bytes + EOS + PAD)."""

  spec = 'byte'
  vocab_size = VOCAB_SIZE
  eos_id = EOS_ID
  pad_id = PAD_ID
  bos_id = None
  fingerprint = hashlib.sha256(b'kimijax byte tokenizer: ids 0-255 utf-8 bytes, 256 EOS, 257 PAD').hexdigest()

  def encode(self, text: str | bytes) -> np.ndarray:
    """Returns the utf-8 bytes of `text` as an int32 array of shape [len]."""
    data = text.encode('utf-8') if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    """Decodes ids (any int array-like); special ids are dropped."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids < 256)]
    return ids.astype(np.uint8).tobytes().decode('utf-8', errors='replace')


def file_sha256(path) -> str:
  """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def as_text(text: str | bytes) -> str:
  """`text` as str: bytes are decoded as UTF-8, invalid sequences replaced by U+FFFD."""
  return text if isinstance(text, str) else bytes(text).decode('utf-8', errors='replace')


@functools.lru_cache(maxsize=8)
def load_tokenizer(spec: str) -> Tokenizer:
  """The tokenizer named by `spec` ('byte' | 'hf:PATH' | 'tiktoken:PATH[#PRESET]'); cached per
  process. Raises DataError naming data.tokenizer and the file when it is missing or does not
  parse."""
  spec = str(spec)
  if spec == 'byte':
    return ByteTokenizer()
  kind, sep, path = spec.partition(':')
  if not sep or not path or kind not in ('hf', 'tiktoken'):
    raise DataError(
      f"data.tokenizer={spec!r} is not one of 'byte', 'hf:PATH' (a tokenizer.json), "
      "'tiktoken:PATH' (a tiktoken BPE file)"
    )
  if kind == 'hf':
    from kimijax.data.tokenizer_hf import HFTokenizer

    return HFTokenizer(spec, path)
  from kimijax.data.tokenizer_tiktoken import TiktokenTokenizer

  return TiktokenTokenizer(spec, path)


def padded_vocab_size(tokenizer_vocab: int) -> int:
  """`tokenizer_vocab` rounded up to a multiple of VOCAB_MULTIPLE (128)."""
  return -(-int(tokenizer_vocab) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_vocab_size(requested: int, tokenizer_vocab: int, tokenizer_spec: str = '') -> int:
  """The model's vocabulary for `model.vocab_size=requested` over a tokenizer of `tokenizer_vocab`
  ids: 0 -> padded_vocab_size(tokenizer_vocab); >= tokenizer_vocab -> requested; smaller -> DataError
  naming both."""
  requested, tokenizer_vocab = int(requested), int(tokenizer_vocab)
  if requested == 0:
    return padded_vocab_size(tokenizer_vocab)
  if requested < tokenizer_vocab:
    which = f'data.tokenizer={tokenizer_spec!r}' if tokenizer_spec else 'the tokenizer'
    raise DataError(
      f'model.vocab_size={requested} is smaller than the vocabulary of {which} '
      f"({tokenizer_vocab} ids); set model.vocab_size=0 to take the tokenizer's, padded "
      f'to a multiple of {VOCAB_MULTIPLE} ({padded_vocab_size(tokenizer_vocab)})'
    )
  return requested


def config_vocab_size(config) -> int:
  """model_vocab_size for a whole config: the tokenizer of config.data (MQAR: its byte ids)."""
  spec = 'byte' if config.data.source == 'mqar' else str(config.data.get('tokenizer', 'byte'))
  return model_vocab_size(config.model.vocab_size, load_tokenizer(spec).vocab_size, spec)
