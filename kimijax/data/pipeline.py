"""Grain input pipeline: packed LM windows (stdlib/text) or synthetic MQAR.

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

from kimijax.data.mqar import mqar_batch, mqar_layout
from kimijax.data.sources import SPLITS, DataError, corpus_report, stdlib_documents, text_documents
from kimijax.data.tokenizer import EOS_ID, VOCAB_SIZE
from kimijax.schema import POSITIVE, Key, defaults

SOURCES = ('stdlib', 'text', 'mqar', 'site_packages')   # site_packages: kimijax/data/site_packages.py
_SPLIT_IDS = {'train': 0, 'validation': 1}
# Prefetch a couple of batches in one background thread; the data is in memory.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=2)


# The `data.*` section of the config (kimijax.schema.Key: default, doc, allowed values or bounds).
DATA_KEYS = {
    'source': Key('stdlib', 'the corpus (kimijax/data/sources.py; site_packages: kimijax/data/site_packages.py)',
                  allowed=SOURCES),
    'path': Key('', "file or folder, for source='text'"),
    'val_fraction': Key(0.05, 'fraction of files (or bytes) for validation', bounds='(0, 1)'),
    'mqar_num_pairs': Key(16, 'key-value pairs per MQAR sequence', bounds=POSITIVE),
}


def default_data_config() -> ml_collections.ConfigDict:
  """The `data.*` section of the config, with defaults."""
  return defaults(DATA_KEYS)


def data_report(config: ml_collections.ConfigDict) -> list[str]:
  """The start-up lines on the data: files and bytes per split (kimijax.data.sources)."""
  d = config.data
  return corpus_report(d.source, d.path, d.val_fraction)


def pack_documents(docs: list[bytes]) -> np.ndarray:
  """Byte tokens of all docs, each followed by EOS: int32 [sum(len) + n_docs]."""
  joined = np.frombuffer(b''.join(docs), dtype=np.uint8).astype(np.int32)
  ends = np.cumsum([len(d) for d in docs])
  return np.insert(joined, ends, EOS_ID)


@functools.lru_cache(maxsize=8)
def packed_tokens(source: str, path: str, split: str, val_fraction: float) -> np.ndarray:
  """Cached (per process) packed tokens of one split: read-only int32 [N]."""
  if source == 'stdlib':
    docs = stdlib_documents(split, val_fraction)
  elif source == 'site_packages':
    from kimijax.data.site_packages import site_packages_documents
    docs = site_packages_documents(split, val_fraction)
  else:
    docs = text_documents(path, split, val_fraction)
  tokens = pack_documents(docs)
  tokens.flags.writeable = False
  return tokens


def _gather_windows(idx: np.ndarray, tokens: np.ndarray, seq_len: int) -> dict:
  """Window indices [B] -> inputs/targets [B, T] int32, mask [B, T] float32."""
  win = tokens[idx[:, None] * seq_len + np.arange(seq_len + 1)]
  return {
      'inputs': win[:, :-1],
      'targets': win[:, 1:],
      'mask': np.ones((len(idx), seq_len), dtype=np.float32),
  }


def _mqar_rows(batch_index: int, *, seed: int, split_id: int, rows: range,
               seq_len: int, num_pairs: int) -> dict:
  """Rows `rows` of global MQAR batch `batch_index`; each row has its own rng."""
  parts = [
      mqar_batch(np.random.default_rng([seed, split_id, batch_index, r]), 1,
                 seq_len, num_pairs=num_pairs, vocab_size=VOCAB_SIZE)
      for r in rows
  ]
  return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _local_batches(config, split: str, process_index: int, process_count: int):
  """MapDataset whose element b is this process's rows of global batch b."""
  source, data = config.data.source, config.data
  batch, seq_len = int(config.train.batch_size), int(config.train.seq_len)
  if source not in SOURCES:
    raise DataError(f'data.source={source!r} is not one of {SOURCES}')
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if batch < 1 or seq_len < 1:
    raise DataError(
        f'train.batch_size={batch} and train.seq_len={seq_len} must be >= 1')
  if not 0 <= process_index < process_count or batch % process_count:
    raise DataError(
        f'train.batch_size={batch} must be divisible by process_count='
        f'{process_count} (process_index={process_index})')
  local = batch // process_count
  seed = int(config.seed) % 2**32

  if source == 'mqar':
    mqar_layout(seq_len, int(data.mqar_num_pairs), VOCAB_SIZE)  # validates
    make = functools.partial(
        _mqar_rows, seed=seed, split_id=_SPLIT_IDS[split],
        rows=range(process_index * local, (process_index + 1) * local),
        seq_len=seq_len, num_pairs=int(data.mqar_num_pairs))
    return grain.MapDataset.range(sys.maxsize).map(make), None

  tokens = packed_tokens(source, str(data.path), split, float(data.val_fraction))
  num_windows = (len(tokens) - 1) // seq_len
  if num_windows < batch:
    raise DataError(
        f"the {split!r} split of data.source={source!r}"
        f"{f' (data.path={data.path!r})' if source == 'text' else ''} has"
        f' {len(tokens)} tokens = {num_windows} sequences of train.seq_len='
        f'{seq_len}, fewer than one global batch of train.batch_size={batch}')
  ds = grain.MapDataset.range(num_windows)
  if split == 'train':
    # Derive the shuffle seed: grain reshuffles epoch e with seed + e.
    ds = ds.shuffle(int(np.random.SeedSequence(seed).generate_state(1)[0]))
  ds = ds.repeat()  # forever; a new shuffle each epoch
  ds = ds.batch(local, drop_remainder=True)[process_index::process_count]
  gather = functools.partial(_gather_windows, tokens=tokens, seq_len=seq_len)
  return ds.map(gather), num_windows


class DataLoader:
  """Infinite iterator of this process's batches, with checkpointable state.

  Yields {'inputs': [B_local, T] int32, 'targets': [B_local, T] int32,
  'mask': [B_local, T] float32}.
  """

  def __init__(self, config, split: str, *, process_index: int = 0,
               process_count: int = 1):
    self.source = config.data.source
    self.split = split
    self._ds, self.num_sequences = _local_batches(
        config, split, process_index, process_count)
    self.global_batch_size = int(config.train.batch_size)
    self.batch_size = self.global_batch_size // process_count
    self.seq_len = int(config.train.seq_len)
    self.vocab_size = VOCAB_SIZE
    self.tokens_per_batch = self.global_batch_size * self.seq_len
    self._iter = iter(self._ds.to_iter_dataset(_READ_OPTIONS))

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    return next(self._iter)

  def get_state(self) -> dict:
    """JSON-serialisable; identical on all processes (global batch index)."""
    return {'source': self.source, 'split': self.split,
            'iterator': self._iter.get_state()}

  def set_state(self, state: dict) -> None:
    """Continues with exactly the batches that followed `state`."""
    if (state.get('source'), state.get('split')) != (self.source, self.split):
      raise DataError(
          f"loader state is for data.source={state.get('source')!r} split="
          f"{state.get('split')!r}, but this loader is data.source="
          f'{self.source!r} split={self.split!r}')
    self._iter.set_state(state['iterator'])

  def close(self) -> None:
    """Stops the background prefetch thread."""
    self._iter.close()


def make_loader(config, split: str, *, process_index: int = 0,
                process_count: int = 1) -> DataLoader:
  """Builds the loader for `split`; raises DataError on bad config/data."""
  return DataLoader(config, split, process_index=process_index,
                    process_count=process_count)


def eval_batches(config, num_batches: int, *, process_index: int = 0,
                 process_count: int = 1) -> list[dict[str, np.ndarray]]:
  """The first `num_batches` validation batches (unshuffled, wrapping around).

  Same result on every call; rows sharded like the training loader.
  """
  ds, _ = _local_batches(config, 'validation', process_index, process_count)
  return [ds[b] for b in range(num_batches)]
