"""Corpora and tokenizer files the data tests generate (nothing is downloaded): documents cut from
the Python stdlib's source plus non-ASCII text, a byte-level BPE trained on them, the same BPE
written as a tiktoken file, and input files in every format prepare reads."""

import base64
import gzip
import hashlib
import json
import pathlib
import sysconfig

import ml_collections
import numpy as np

from kimijax.data import default_data_config

UNICODE_DOCS = [
  'naïve café — déjà vu ✓ 日本語のテキスト 中文 한국어 emoji 🎉🚀 and Ωμέγα',
  'tabs\tand  double  spaces\r\nwindows line\r\n\n\n   trailing   ',
  'the literal text <|endoftext|> and <|pad|> is ordinary text here',
  'x' * 30_000 + '\n' + 'long line without spaces ' + 'y' * 26_000,
]


def stdlib_texts(n_files=40, start=0) -> list[str]:
  """The text of n_files top-level stdlib modules (sorted by name, from `start`)."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(root.glob('*.py'))[start : start + n_files]
  return [f.read_text(encoding='utf-8', errors='replace') for f in files]


def documents(n_files=12) -> list[str]:
  """Small documents: stdlib modules cut at blank-line paragraphs (~100 docs), the unicode ones, and
  an exact duplicate."""
  docs = []
  for text in stdlib_texts(n_files, start=7):
    paragraphs = text.split('\n\n')
    for i in range(0, len(paragraphs), 25):
      docs.append('\n\n'.join(paragraphs[i : i + 25]))
  docs += UNICODE_DOCS
  docs.append(docs[3])
  return [d for d in docs if d]


def small_documents(n_files=3) -> list[str]:
  """Many short documents: the blank-line paragraphs of n_files stdlib modules, plus UNICODE_DOCS[:3]."""
  docs = [p for text in stdlib_texts(n_files, start=20) for p in text.split('\n\n') if p.strip()]
  return docs + UNICODE_DOCS[:3]


def byte_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table of byte-level BPE vocabularies."""
  keep = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
  table, extra = {}, 0
  for b in range(256):
    if b in keep:
      table[b] = chr(b)
    else:
      table[b] = chr(256 + extra)
      extra += 1
  return table


def write_tiktoken(hf_tokenizer_json: pathlib.Path, path: pathlib.Path) -> int:
  """Writes the byte-level BPE of a tokenizer.json as a tiktoken file (ranks = ids - 2, without
  the two special tokens); returns the number of ranks."""
  vocab = json.loads(hf_tokenizer_json.read_text())['model']['vocab']
  to_byte = {c: b for b, c in byte_to_unicode().items()}
  lines = []
  for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
    if i < 2:
      continue
    data = bytes(to_byte[c] for c in token)
    lines.append(f'{base64.b64encode(data).decode()} {i - 2}')
  path.write_text('\n'.join(lines) + '\n')
  return len(lines)


def doc_split(text: str | bytes, val_fraction: float) -> str:
  """The split rule, restated: validation iff the SHA-256's first 8 bytes / 2^64 < val_fraction."""
  data = text.encode('utf-8') if isinstance(text, str) else text
  return 'validation' if int(hashlib.sha256(data).hexdigest()[:16], 16) < val_fraction * 2**64 else 'train'


def write_inputs(root: pathlib.Path, docs: list[str]) -> pathlib.Path:
  """The documents spread over every input format prepare reads (order: jsonl, jsonl.gz, jsonl.zst,
  parquet, txt files); returns root. Also writes one non-text file, which must be skipped."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard

  root.mkdir(parents=True, exist_ok=True)
  parts = np.array_split(np.arange(len(docs)), 5)
  lines = lambda idx: ''.join(json.dumps({'id': int(i), 'text': docs[i]}) + '\n' for i in idx)
  (root / 'a.jsonl').write_text(lines(parts[0]))
  with gzip.open(root / 'b.jsonl.gz', 'wt') as f:
    f.write(lines(parts[1]))
  (root / 'c.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(lines(parts[2]).encode()))
  pq.write_table(
    pa.table({'id': parts[3].tolist(), 'text': [docs[i] for i in parts[3]]}), root / 'd.parquet', row_group_size=7
  )
  (root / 'txt').mkdir(exist_ok=True)
  for i in parts[4]:
    (root / 'txt' / f'doc{i:04d}.txt').write_text(docs[i], encoding='utf-8')
  (root / 'txt' / 'image.bin').write_bytes(bytes(range(256)) * 4)
  (root / '.hidden.txt').write_text('HIDDEN')
  return root


def input_order(docs: list[str]) -> list[str]:
  """The documents in prepare's order over write_inputs' files (sorted paths; within a file, file
  order)."""
  parts = np.array_split(np.arange(len(docs)), 5)
  return [docs[i] for part in parts for i in part]


def make_config(batch_size=4, seq_len=8, seed=0, **data):
  c = ml_collections.ConfigDict()
  c.seed = seed
  c.train = ml_collections.ConfigDict({'batch_size': batch_size, 'seq_len': seq_len})
  c.data = default_data_config()
  c.data.update(data)
  return c


def write_token_corpus(
  root: pathlib.Path, tokenizer, shard_tokens: list[int], mean_doc=700, seed=0, val_shards=1
) -> pathlib.Path:
  """A shard folder written directly (not by prepare): shards of random byte tokens with documents of
  random lengths, each ending in EOS; the last `val_shards` shards form the validation split."""
  from kimijax.data import shards as shards_lib

  rng = np.random.default_rng(seed)
  records = []
  for i, n in enumerate(shard_tokens):
    tokens = rng.integers(0, 256, size=n, dtype=np.uint16)
    ends = np.unique(np.concatenate([np.cumsum(rng.integers(1, 2 * mean_doc, size=n // mean_doc + 2)), [n]]))
    ends = ends[ends <= n]
    tokens[ends - 1] = tokenizer.eos_id
    records.append(shards_lib.write_shard(root, f'shard-{i:04d}', tokens, np.concatenate([[0], ends])))
  split = {'train': records[: len(records) - val_shards], 'validation': records[len(records) - val_shards :]}
  manifest = {
    'format': shards_lib.FORMAT,
    'version': shards_lib.VERSION,
    'dtype': 'uint16',
    'tokenizer': tokenizer.describe(),
    'text_bytes': 0,
    'splits': {
      s: {'docs': sum(r['docs'] for r in rs), 'tokens': sum(r['tokens'] for r in rs), 'shards': rs}
      for s, rs in split.items()
    },
  }
  (root / 'manifest.json').write_text(json.dumps(manifest))
  return root
