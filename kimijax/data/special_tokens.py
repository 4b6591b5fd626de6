"""Which ids of a BPE tokenizer are EOS, BOS and PAD.

A tokenizer file names its special tokens but not their roles. The roles come, in this order, from
the Hugging Face files that ship beside it (`tokenizer_config.json`, then `special_tokens_map.json`:
keys `eos_token`, `bos_token`, `pad_token`, each a string or {'content': string}), then from the
conventional names below, looked up among the tokenizer's tokens. No EOS found is an error (the
pipeline needs the document separator); no BOS is None; no PAD is the EOS id (padded positions carry
mask 0, so the id only needs to be valid).
"""

from __future__ import annotations

import json
import pathlib

from kimijax.data.sources import DataError

SIDECAR_FILES = ('tokenizer_config.json', 'special_tokens_map.json')
CONVENTIONAL = {
  'eos': ('<|endoftext|>', '<|end_of_text|>', '</s>', '<eos>', '[EOS]', '<|eos|>'),
  'bos': ('<|begin_of_text|>', '<|startoftext|>', '<s>', '<bos>', '[BOS]', '<|bos|>'),
  'pad': ('<|pad|>', '<pad>', '[PAD]'),
}


def sidecar_config(path: pathlib.Path) -> dict:
  """The merged sidecar files next to tokenizer file `path` ({} when none); a sidecar that is not
  JSON is a DataError naming it."""
  merged = {}
  for name in reversed(SIDECAR_FILES):  # tokenizer_config.json wins
    side = path.parent / name
    if side.is_file():
      try:
        data = json.loads(side.read_text(encoding='utf-8'))
      except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f'data.tokenizer: {side} is not valid JSON ({e})') from None
      if isinstance(data, dict):
        merged.update(data)
  return merged


def _content(value) -> str | None:
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) and value else None


def special_roles(path: pathlib.Path, token_to_id: dict[str, int], sidecar: dict) -> dict[str, int | None]:
  """{'eos': id, 'bos': id or None, 'pad': id} of the tokenizer at `path` whose special (and
  other) tokens map to ids by `token_to_id` (see the module docstring)."""
  roles = {}
  for role in ('eos', 'bos', 'pad'):
    named = _content(sidecar.get(f'{role}_token'))
    if named is not None:
      if named not in token_to_id:
        raise DataError(
          f'data.tokenizer: {role}_token {named!r} of {path.parent / SIDECAR_FILES[0]} is not a token of {path}'
        )
      roles[role] = token_to_id[named]
      continue
    roles[role] = next((token_to_id[n] for n in CONVENTIONAL[role] if n in token_to_id), None)
  if roles['eos'] is None:
    raise DataError(
      f'data.tokenizer: {path} has no end-of-document token (none of '
      f'{", ".join(CONVENTIONAL["eos"])}); name it as eos_token in a tokenizer_config.json '
      'beside the file'
    )
  if roles['pad'] is None:
    roles['pad'] = roles['eos']
  return roles
