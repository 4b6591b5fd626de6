"""Training a byte-level BPE tokenizer (Hugging Face `tokenizers`) on a sample of documents.

The tokenizer: no normalizer, GPT-2's byte-level pre-tokenizer (its regex, no prefix space) and
decoder, so decode(encode(text)) == text for any text; the 256 byte symbols are always in the
vocabulary; special tokens '<|endoftext|>' (id 0, EOS: the document separator) and '<|pad|>' (id 1).
Training is deterministic: the same documents in the same order give the same tokenizer.json, byte
for byte (the trainer's merge ties break on the pair, not on hash order).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable

from kimijax.data.sources import DataError

EOS_TOKEN, PAD_TOKEN = '<|endoftext|>', '<|pad|>'
MIN_VOCAB = 256 + 2


def check_vocab_size(vocab_size: int) -> None:
  """DataError if a BPE of `vocab_size` ids cannot hold the 256 bytes, EOS and PAD."""
  if vocab_size < MIN_VOCAB:
    raise DataError(f'--train_tokenizer={vocab_size} is below {MIN_VOCAB} (256 bytes + EOS + PAD)')


def train_bpe(texts: Iterable[str], vocab_size: int):
  """A tokenizers.Tokenizer trained on `texts` with at most `vocab_size` ids (module docstring)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  check_vocab_size(vocab_size)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=2,
    show_progress=False,
    special_tokens=[EOS_TOKEN, PAD_TOKEN],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator(texts, trainer)
  return tok


def save_bpe(tok, directory: pathlib.Path) -> pathlib.Path:
  """Writes DIR/tokenizer.json and a tokenizer_config.json naming EOS and PAD (atomically: the
  config first, the tokenizer last); returns the tokenizer.json path."""
  directory = pathlib.Path(directory)
  config = directory / 'tokenizer_config.json'
  tmp = config.with_suffix('.json.tmp')
  tmp.write_text(json.dumps({'eos_token': EOS_TOKEN, 'pad_token': PAD_TOKEN}, indent=1) + '\n')
  os.replace(tmp, config)
  path = directory / 'tokenizer.json'
  tmp = path.with_suffix('.json.tmp')
  tmp.write_text(tok.to_str(pretty=True))
  os.replace(tmp, path)
  return path
