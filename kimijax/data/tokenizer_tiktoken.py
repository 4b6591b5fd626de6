"""A tiktoken-format BPE file behind kimijax's Tokenizer interface.

The file holds the mergeable ranks only: one `base64(token bytes) rank` per line (OpenAI's .tiktoken
files, Kimi's tiktoken.model). The pre-tokenization regex and the special tokens are not in it; they
come from a preset, chosen in this order:
  1. named in the spec: 'tiktoken:PATH#kimi' (or #cl100k_base, #o200k_base, #p50k_base, #r50k_base,
     #default);
  2. the file's SHA-256 is one of OpenAI's published encodings (the hashes tiktoken checks its
     downloads against) -> that encoding's regex and special tokens;
  3. a tokenizer_config.json beside the file whose auto_map names tokenization_kimi (as Kimi's
     checkpoints ship), or a tokenization_kimi.py beside it -> 'kimi';
  4. otherwise 'default': cl100k_base's regex (the most widely shared tiktoken pattern, and the base
     of Llama 3's and Kimi's) and one special token, '<|endoftext|>', right after the ranks (where
     r50k/p50k place it).
Kimi's preset (from Moonshot's tokenization_kimi.py): its own regex (Han runs split from other
letters), and 256 + 2 special ids right after the ranks, named by the tokenizer_config.json's
added_tokens_decoder and '<|reserved_token_ID|>' otherwise; EOS '[EOS]' and BOS '[BOS]' unless the
config names others. With every preset, special tokens named in a tokenizer_config.json's
added_tokens_decoder are added, and the EOS / BOS / PAD roles follow
kimijax/data/special_tokens.py.

Text is encoded as ordinary text (special tokens spelled in it are not special). A document longer
than MAX_PIECE_CHARS is encoded in pieces, cut after a newline that a non-space character follows
where there is one (no pre-token of these regexes spans such a point, so the ids are those of the
whole text) and at MAX_PIECE_CHARS otherwise: tiktoken is slow on very long runs without
whitespace (tiktoken issue 195; Kimi's tokenizer caps runs at 25,000 characters the same way).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import pathlib

import numpy as np

from kimijax.data import special_tokens
from kimijax.data.sources import DataError
from kimijax.data.tokenizer import Tokenizer, as_text, file_sha256

MAX_PIECE_CHARS = 25_000
ENDOFTEXT = '<|endoftext|>'

_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K_PAT = (
  r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|"""
  r"""\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PAT = '|'.join(
  [
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
  ]
)
_NOT_HAN_UPPER = r'[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]'
_NOT_HAN_LOWER = r'[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]'
_KIMI_PAT = '|'.join(
  [
    r'[\p{Han}]+',
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r'\p{N}{1,3}',
    r' ?[^\s\p{L}\p{N}]+[\r\n]*',
    r'\s*[\r\n]+',
    r'\s+(?!\S)',
    r'\s+',
  ]
)
KIMI_NUM_SPECIAL = 256 + 2

# name -> (regex, {special token: id}); ids of OpenAI's encodings as tiktoken defines them.
PRESETS = {
  'r50k_base': (_R50K_PAT, {ENDOFTEXT: 50256}),
  'p50k_base': (_R50K_PAT, {ENDOFTEXT: 50256}),
  'cl100k_base': (
    _CL100K_PAT,
    {
      ENDOFTEXT: 100257,
      '<|fim_prefix|>': 100258,
      '<|fim_middle|>': 100259,
      '<|fim_suffix|>': 100260,
      '<|endofprompt|>': 100276,
    },
  ),
  'o200k_base': (_O200K_PAT, {ENDOFTEXT: 199999, '<|endofprompt|>': 200018}),
  'kimi': (_KIMI_PAT, None),  # specials from the ranks' count and the sidecar config
  'default': (_CL100K_PAT, None),  # '<|endoftext|>' right after the ranks
}
# SHA-256 of OpenAI's published .tiktoken files (tiktoken_ext/openai_public.py's expected_hash).
OPENAI_FILE_SHA256 = {
  '306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930': 'r50k_base',
  '94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069': 'p50k_base',
  '223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7': 'cl100k_base',
  '446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d': 'o200k_base',
}


def read_ranks(path: pathlib.Path, spec: str) -> dict[bytes, int]:
  """{token bytes: rank} of a tiktoken BPE file; a malformed line is a DataError naming file:line."""
  ranks, seen = {}, set()
  with open(path, 'rb') as f:
    for lineno, line in enumerate(f, 1):
      parts = line.split()
      if not parts:
        continue
      try:
        if len(parts) != 2:
          raise ValueError('expected two fields')
        token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        if rank < 0 or rank in seen or token in ranks:
          raise ValueError('duplicate or negative rank')
      except (ValueError, binascii.Error) as e:
        raise DataError(
          f"data.tokenizer={spec!r}: {path}:{lineno} is not a 'base64-token rank' line of a tiktoken BPE file ({e})"
        ) from None
      ranks[token] = rank
      seen.add(rank)
  if not ranks:
    raise DataError(f'data.tokenizer={spec!r}: {path} holds no ranks (not a tiktoken BPE file)')
  return ranks


def _choose_preset(path: pathlib.Path, file_hash: str, sidecar: dict, named: str, spec: str) -> str:
  if named:
    if named not in PRESETS:
      raise DataError(f'data.tokenizer={spec!r}: unknown preset {named!r}; one of {sorted(PRESETS)}')
    return named
  if file_hash in OPENAI_FILE_SHA256:
    return OPENAI_FILE_SHA256[file_hash]
  auto_map = json.dumps(sidecar.get('auto_map', {}))
  if 'tokenization_kimi' in auto_map or (path.parent / 'tokenization_kimi.py').is_file():
    return 'kimi'
  return 'default'


def _special_tokens(preset: str, num_ranks: int, sidecar: dict) -> dict[str, int]:
  specials = dict(PRESETS[preset][1] or {})
  added = {int(i): special_tokens._content(t) for i, t in (sidecar.get('added_tokens_decoder') or {}).items()}
  if preset == 'kimi':
    for i in range(num_ranks, num_ranks + KIMI_NUM_SPECIAL):
      specials[added.get(i) or f'<|reserved_token_{i}|>'] = i
  elif preset == 'default' and ENDOFTEXT not in added.values():
    specials[ENDOFTEXT] = num_ranks
  for i, name in added.items():
    if name and i >= num_ranks:
      specials.setdefault(name, i)
  return specials


def split_long(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
  """`text` cut into pieces of at most `limit` characters (see the module docstring)."""
  pieces, start = [], 0
  while len(text) - start > limit:
    end = start + limit
    cut = end
    while True:  # the last '\n' in (start, end] that a non-space follows
      nl = text.rfind('\n', start, cut)
      if nl < 0:
        cut = end
        break
      if not text[nl + 1].isspace():
        cut = nl + 1
        break
      cut = nl
    pieces.append(text[start:cut])
    start = cut
  pieces.append(text[start:])
  return pieces


class TiktokenTokenizer(Tokenizer):
  """Tokenizer of the tiktoken BPE file in `spec` = 'tiktoken:PATH[#PRESET]'."""

  def __init__(self, spec: str, path: str):
    import tiktoken

    path, _, named = path.partition('#')
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
      raise DataError(f'data.tokenizer={spec!r}: {file} does not exist')
    ranks = read_ranks(file, spec)
    file_hash = file_sha256(file)
    sidecar = special_tokens.sidecar_config(file)
    self.preset = _choose_preset(file, file_hash, sidecar, named, spec)
    pattern = PRESETS[self.preset][0]
    specials = _special_tokens(self.preset, len(ranks), sidecar)
    clash = sorted(set(specials.values()) & set(ranks.values()))
    if clash:
      raise DataError(
        f'data.tokenizer={spec!r}: special token ids {clash[:3]} of preset {self.preset!r} are '
        f'ranks of {file}; name the preset (tiktoken:PATH#PRESET)'
      )
    try:
      self._enc = tiktoken.Encoding(name=file.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    except Exception as e:
      raise DataError(f'data.tokenizer={spec!r}: tiktoken rejects {file} ({" ".join(str(e).split())[:200]})') from None
    token_to_id = dict(specials)
    for name in special_tokens.CONVENTIONAL['eos'] + special_tokens.CONVENTIONAL['bos']:
      if name not in token_to_id and name.encode() in ranks:
        token_to_id[name] = ranks[name.encode()]
    roles = special_tokens.special_roles(file, token_to_id, sidecar)
    self._ordinary_max = max(ranks.values())
    self._is_rank = np.zeros(self._ordinary_max + 1, dtype=bool)
    self._is_rank[list(ranks.values())] = True
    self.spec = spec
    self.path = str(file)
    self.vocab_size = max(self._ordinary_max, *specials.values()) + 1
    self.eos_id, self.bos_id, self.pad_id = roles['eos'], roles['bos'], roles['pad']
    self.fingerprint = hashlib.sha256(
      json.dumps(['tiktoken', file_hash, pattern, sorted(specials.items()), roles], sort_keys=True).encode()
    ).hexdigest()

  def encode_batch(self, texts) -> list[np.ndarray]:
    out = []
    for text in texts:
      ids = [i for piece in split_long(as_text(text)) for i in self._enc.encode_ordinary(piece)]
      out.append(np.asarray(ids, dtype=np.int32))
    return out

  def decode(self, ids) -> str:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ids = ids[(ids >= 0) & (ids <= self._ordinary_max)]
    ids = ids[self._is_rank[ids]]
    return self._enc.decode_bytes(ids.tolist()).decode('utf-8', errors='replace')
