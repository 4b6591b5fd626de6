"""Grain input pipeline: packed LM windows (stdlib / text / site_packages / shards) or synthetic MQAR.

Batch contract: every batch is a dict of [B_local, T] arrays (T = train.seq_len):
  inputs      int32    token ids
  targets     int32    the next token of each input (the stream shifted by one)
  mask        float32  1 where the target counts in the loss (all ones for packed corpora; MQAR:
                       the queried values)
and, with data.document_mask = True (kimijax/data/documents.py):
  segment_ids int32    1, 2, ... per document within a row (0 = padding; packed rows have none);
                       a segment opens at the row's first token and at each EOS
  positions   int32    index of the token within its segment (0 at each segment's first token)
MQAR rows are one document each (segment_ids all 1, positions 0..T-1).

Packed corpora: the split's documents, each followed by the tokenizer's EOS, form one stream;
window w is stream[w*T : w*T + T + 1] (inputs = window[:-1], targets = window[1:]). Train windows are
shuffled from the seed (a new order each epoch); validation windows are in order. Text sources
(stdlib, text, site_packages) are tokenized in memory by data.tokenizer; 'shards' reads the token
shards that `python -m kimijax.data.prepare` wrote to data.path, by positional reads of only the
windows of this process's rows (kimijax/data/shards.py), and takes its splits from their manifest.

Sharding contract: global batch b is a fixed set of B = train.batch_size rows,
whatever the process count; process p yields rows [p*B_local, (p+1)*B_local)
of it (B_local = B // process_count) and only builds those rows. The loader
state is the global batch index, so it is the same on every process.
"""

from __future__ import annotations

import functools
import sys

import grain
import ml_collections
import numpy as np

from kimijax.data import documents
from kimijax.data.mqar import mqar_batch, mqar_layout
from kimijax.data.sources import SPLITS, DataError, corpus_report, stdlib_documents, text_documents
from kimijax.data.tokenizer import EOS_ID, VOCAB_SIZE, load_tokenizer
from kimijax.schema import POSITIVE, Key, defaults

# site_packages: kimijax/data/site_packages.py; shards: kimijax/data/shards.py (python -m kimijax.data.prepare)
SOURCES = ('stdlib', 'text', 'mqar', 'site_packages', 'shards')
_SPLIT_IDS = {'train': 0, 'validation': 1}
# Prefetch a couple of batches in one background thread; the data is in memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


# The `data.*` section of the config (kimijax.schema.Key: default, doc, allowed values or bounds).
DATA_KEYS = {
  'source': Key(
    'stdlib', 'the corpus (kimijax/data/sources.py; site_packages: kimijax/data/site_packages.py)', allowed=SOURCES
  ),
  'path': Key('', "file or folder for source='text'; the prepared folder for 'shards'"),
  'val_fraction': Key(
    0.05, "fraction of files (or bytes) for validation; 'shards': the manifest's split", bounds='(0, 1)'
  ),
  'mqar_num_pairs': Key(16, 'key-value pairs per MQAR sequence', bounds=POSITIVE),
  'tokenizer': Key('byte', "'byte' | 'hf:PATH' | 'tiktoken:PATH[#PRESET]' (kimijax/data/tokenizer.py)"),
  'document_mask': Key(False, 'batches also carry segment_ids and positions [B, T] (module docstring)'),
}


def default_data_config() -> ml_collections.ConfigDict:
  """The `data.*` section of the config, with defaults."""
  return defaults(DATA_KEYS)


def tokenizer_spec(config) -> str:
  """The tokenizer the data of `config` is in: data.tokenizer ('byte' for MQAR's synthetic ids)."""
  return 'byte' if config.data.source == 'mqar' else str(config.data.get('tokenizer', 'byte'))


def data_report(config: ml_collections.ConfigDict) -> list[str]:
  """The start-up lines on the data: files and bytes per split (kimijax.data.sources), or the
  shards' documents and tokens per split."""
  d = config.data
  if d.source == 'shards':
    from kimijax.data.shards import read_manifest

    m = read_manifest(d.path)
    lines = [
      f'data: shards ({d.path}), tokenizer {m["tokenizer"]["spec"]} ({m["tokenizer"]["vocab_size"]:,} ids), '
      f'{m["text_bytes"]:,} bytes of text'
    ]
    for split in SPLITS:
      s = m['splits'][split]
      lines.append(f'  {split:<10} {s["docs"]:>10,} documents {s["tokens"]:>16,} tokens {len(s["shards"]):>6,} shards')
    return lines
  lines = corpus_report(d.source, d.path, d.val_fraction)
  if tokenizer_spec(config) != 'byte':
    lines.insert(1, f'  tokenizer  {tokenizer_spec(config)}')
  return lines


def pack_documents(docs: list[bytes], tokenizer=None) -> np.ndarray:
  """Tokens of all docs, each followed by EOS: int32 [sum(len) + n_docs]. `tokenizer` None:
  the byte tokenizer."""
  if tokenizer is None or tokenizer.spec == 'byte':
    joined = np.frombuffer(b''.join(docs), dtype=np.uint8).astype(np.int32)
    ends = np.cumsum([len(d) for d in docs])
    return np.insert(joined, ends, EOS_ID)
  eos = np.array([tokenizer.eos_id], dtype=np.int32)
  ids = tokenizer.encode_batch(docs)
  return np.concatenate([x for t in ids for x in (t, eos)]) if ids else np.zeros(0, np.int32)


@functools.lru_cache(maxsize=8)
def packed_tokens(source: str, path: str, split: str, val_fraction: float, tokenizer: str = 'byte') -> np.ndarray:
  """Cached (per process) packed tokens of one split of a text source: read-only int32 [N]."""
  if source == 'stdlib':
    docs = stdlib_documents(split, val_fraction)
  elif source == 'site_packages':
    from kimijax.data.site_packages import site_packages_documents

    docs = site_packages_documents(split, val_fraction)
  else:
    docs = text_documents(path, split, val_fraction)
  tokens = pack_documents(docs, None if tokenizer == 'byte' else load_tokenizer(tokenizer))
  tokens.flags.writeable = False
  return tokens


def split_tokens(config, split: str):
  """The packed token stream of `split` of a packed source: an int32 array (text sources) or a
  ShardSplit (shards; `.read(start, n)`); len() is its token count."""
  d = config.data
  if d.source == 'shards':
    from kimijax.data.shards import open_split

    return open_split(str(d.path), split, load_tokenizer(tokenizer_spec(config)))
  return packed_tokens(d.source, str(d.path), split, float(d.val_fraction), tokenizer_spec(config))


def split_num_tokens(config, split: str = 'train') -> int | None:
  """Tokens in `split` of config's data (None for the endless synthetic MQAR); epochs = tokens
  trained / this."""
  if config.data.source == 'mqar':
    return None
  if config.data.source == 'shards':
    from kimijax.data.shards import read_manifest

    return int(read_manifest(config.data.path)['splits'][split]['tokens'])
  return len(split_tokens(config, split))


def _gather_windows(idx: np.ndarray, tokens, seq_len: int, eos_id: int | None = None) -> dict:
  """Window indices [B] -> inputs/targets [B, T] int32, mask [B, T] float32 (and, with eos_id,
  segment_ids / positions [B, T] int32). `tokens`: an int32 array or a ShardSplit."""
  if isinstance(tokens, np.ndarray):
    win = tokens[idx[:, None] * seq_len + np.arange(seq_len + 1)]
  else:
    win = tokens.read_rows(np.asarray(idx, dtype=np.int64) * seq_len, seq_len + 1)
  batch = {
    'inputs': win[:, :-1],
    'targets': win[:, 1:],
    'mask': np.ones((len(idx), seq_len), dtype=np.float32),
  }
  if eos_id is not None:
    batch['segment_ids'], batch['positions'] = documents.document_ids(batch['inputs'], eos_id)
  return batch


def _mqar_rows(
  batch_index: int, *, seed: int, split_id: int, rows: range, seq_len: int, num_pairs: int, document_mask: bool = False
) -> dict:
  """Rows `rows` of global MQAR batch `batch_index`; each row has its own rng."""
  parts = [
    mqar_batch(
      np.random.default_rng([seed, split_id, batch_index, r]), 1, seq_len, num_pairs=num_pairs, vocab_size=VOCAB_SIZE
    )
    for r in rows
  ]
  batch = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
  if document_mask:
    batch['segment_ids'], batch['positions'] = documents.single_document(len(rows), seq_len)
  return batch


def _local_batches(config, split: str, process_index: int, process_count: int):
  """MapDataset whose element b is this process's rows of global batch b."""
  source, data = config.data.source, config.data
  batch, seq_len = int(config.train.batch_size), int(config.train.seq_len)
  if source not in SOURCES:
    raise DataError(f'data.source={source!r} is not one of {SOURCES}')
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if batch < 1 or seq_len < 1:
    raise DataError(f'train.batch_size={batch} and train.seq_len={seq_len} must be >= 1')
  if not 0 <= process_index < process_count or batch % process_count:
    raise DataError(
      f'train.batch_size={batch} must be divisible by process_count={process_count} (process_index={process_index})'
    )
  local = batch // process_count
  seed = int(config.seed) % 2**32
  document_mask = bool(data.get('document_mask', False))

  if source == 'mqar':
    if str(data.get('tokenizer', 'byte')) != 'byte':
      raise DataError(
        f"data.source='mqar' generates ids of the byte vocabulary ({VOCAB_SIZE}); "
        f"data.tokenizer={data.tokenizer!r} must be 'byte'"
      )
    mqar_layout(seq_len, int(data.mqar_num_pairs), VOCAB_SIZE)  # validates
    make = functools.partial(
      _mqar_rows,
      seed=seed,
      split_id=_SPLIT_IDS[split],
      rows=range(process_index * local, (process_index + 1) * local),
      seq_len=seq_len,
      num_pairs=int(data.mqar_num_pairs),
      document_mask=document_mask,
    )
    return grain.MapDataset.range(sys.maxsize).map(make), None

  tokens = split_tokens(config, split)
  num_windows = (len(tokens) - 1) // seq_len
  if num_windows < batch:
    raise DataError(
      f'the {split!r} split of data.source={source!r}'
      f'{f" (data.path={data.path!r})" if source in ("text", "shards") else ""} has'
      f' {max(len(tokens), 0)} tokens = {max(num_windows, 0)} sequences of train.seq_len='
      f'{seq_len}, fewer than one global batch of train.batch_size={batch}'
    )
  ds = grain.MapDataset.range(num_windows)
  if split == 'train':
    # Derive the shuffle seed: grain reshuffles epoch e with seed + e.
    ds = ds.shuffle(int(np.random.SeedSequence(seed).generate_state(1)[0]))
  ds = ds.repeat()  # forever; a new shuffle each epoch
  ds = ds.batch(local, drop_remainder=True)[process_index::process_count]
  eos_id = load_tokenizer(tokenizer_spec(config)).eos_id if document_mask else None
  gather = functools.partial(_gather_windows, tokens=tokens, seq_len=seq_len, eos_id=eos_id)
  return ds.map(gather), num_windows


class DataLoader:
  """Infinite iterator of this process's batches, with checkpointable state.

  Yields {'inputs': [B_local, T] int32, 'targets': [B_local, T] int32,
  'mask': [B_local, T] float32} (+ 'segment_ids', 'positions' [B_local, T] int32 with
  data.document_mask; the module docstring states the contract). `vocab_size`, `eos_id`,
  `pad_id`: the tokenizer's.
  """

  def __init__(self, config, split: str, *, process_index: int = 0, process_count: int = 1):
    self.source = config.data.source
    self.split = split
    self._ds, self.num_sequences = _local_batches(config, split, process_index, process_count)
    self.global_batch_size = int(config.train.batch_size)
    self.batch_size = self.global_batch_size // process_count
    self.seq_len = int(config.train.seq_len)
    tokenizer = load_tokenizer(tokenizer_spec(config))
    self.vocab_size, self.eos_id, self.pad_id = tokenizer.vocab_size, tokenizer.eos_id, tokenizer.pad_id
    self.tokens_per_batch = self.global_batch_size * self.seq_len
    self._iter = iter(self._ds.to_iter_dataset(_READ_OPTIONS))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iter)

  def get_state(self) -> dict:
    """JSON-serialisable; identical on all processes (global batch index)."""
    return {'source': self.source, 'split': self.split, 'iterator': self._iter.get_state()}

  def set_state(self, state: dict) -> None:
    """Continues with exactly the batches that followed `state`."""
    if (state.get('source'), state.get('split')) != (self.source, self.split):
      raise DataError(
        f'loader state is for data.source={state.get("source")!r} split='
        f'{state.get("split")!r}, but this loader is data.source='
        f'{self.source!r} split={self.split!r}'
      )
    self._iter.set_state(state['iterator'])

  def close(self) -> None:
    """Stops the background prefetch thread."""
    self._iter.close()


def make_loader(config, split: str, *, process_index: int = 0, process_count: int = 1) -> DataLoader:
  """Builds the loader for `split`; raises DataError on bad config/data."""
  return DataLoader(config, split, process_index=process_index, process_count=process_count)


def eval_batches(
  config, num_batches: int, *, process_index: int = 0, process_count: int = 1
) -> list[dict[str, np.ndarray]]:
  """The first `num_batches` validation batches (unshuffled, wrapping around).

  Same result on every call; rows sharded like the training loader.
  """
  ds, _ = _local_batches(config, 'validation', process_index, process_count)
  return [ds[b] for b in range(num_batches)]
