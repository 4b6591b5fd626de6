"""Data package: tokenizers, corpora, token shards, MQAR, and the grain pipeline.

Names are imported from their modules on first use (PEP 562), so that `python -m
kimijax.data.prepare` and its worker processes do not import grain.
"""

import importlib

_EXPORTS = {
  'mqar_batch': 'mqar',
  'DataLoader': 'pipeline',
  'data_report': 'pipeline',
  'default_data_config': 'pipeline',
  'eval_batches': 'pipeline',
  'make_loader': 'pipeline',
  'pack_documents': 'pipeline',
  'split_num_tokens': 'pipeline',
  'DataError': 'sources',
  'split_files': 'sources',
  'stdlib_documents': 'sources',
  'stdlib_files': 'sources',
  'text_documents': 'sources',
  'EOS_ID': 'tokenizer',
  'PAD_ID': 'tokenizer',
  'ByteTokenizer': 'tokenizer',
  'Tokenizer': 'tokenizer',
  'config_vocab_size': 'tokenizer',
  'load_tokenizer': 'tokenizer',
  'model_vocab_size': 'tokenizer',
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  value = getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(__all__))
