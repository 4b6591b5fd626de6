"""Token shards on disk: the format `kimijax.data.prepare` writes and `data.source='shards'` reads.

DIR/manifest.json           written last: the corpus is complete iff it exists (format below)
DIR/shards/SPLIT-UNIT.bin   the split's documents of one unit of input, each followed by EOS, as
                            little-endian uint16 (vocab <= 65,536) or uint32 tokens
DIR/shards/SPLIT-UNIT.idx   int64 [docs + 1]: token offsets of the documents in the .bin (0 first,
                            the token count last); document d is bin[idx[d]:idx[d + 1]], its EOS last
DIR/tokenizer.json          the tokenizer, when prepare trained it (with tokenizer_config.json)

manifest.json: {'format', 'version', 'dtype', 'tokenizer': Tokenizer.describe(), 'val_fraction',
'text_field', 'split_rule', 'sources': [{path, size, sha256}], 'text_bytes', 'documents_skipped',
'splits': {SPLIT: {'docs', 'tokens', 'shards': [{file, index, docs, tokens, bytes, sha256,
edge_sha256, index_sha256}]}}}.

A split reads as one stream: its shards concatenated in manifest order. Opening a split checks, per
shard, the size against the manifest (a truncated file) and the SHA-256 of its first and last
EDGE_BYTES (a cheap check for a corrupt or replaced file; `verify_split` reads every byte), and the
manifest's tokenizer fingerprint against the config's. Reads are positional (os.pread) of exactly
the tokens asked for: the reader holds no map of the files and no more than one read in memory, so a
corpus larger than RAM trains.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import json
import os
import pathlib
import threading

import numpy as np

from kimijax.data.sources import DataError
from kimijax.data.tokenizer import file_sha256

FORMAT = 'kimijax-token-shards'
VERSION = 1
EDGE_BYTES = 1 << 16
MAX_OPEN_FILES = 64
SHARDS_DIR = 'shards'


def edge_sha256(path: pathlib.Path, size: int) -> str:
  """Hex SHA-256 of a file's first and last EDGE_BYTES bytes (the whole file when smaller)."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    h.update(f.read(EDGE_BYTES))
    if size > EDGE_BYTES:
      f.seek(max(EDGE_BYTES, size - EDGE_BYTES))
      h.update(f.read(EDGE_BYTES))
  return h.hexdigest()


class ShardWriter:
  """Writes DIR/shards/NAME.bin and NAME.idx document by document, with memory bounded by what one
  `append` holds: tokens go to a temporary file as they come and the index keeps one int64 per
  document. `close()` renames both into place (the .idx first) and returns the
  shard's manifest record; a writer that is never closed leaves only '*.tmp' files."""

  def __init__(self, directory: pathlib.Path, name: str, dtype):
    self.folder = pathlib.Path(directory) / SHARDS_DIR
    self.folder.mkdir(parents=True, exist_ok=True)
    self.name, self.dtype = name, np.dtype(dtype).newbyteorder('<')
    self._tmp = self.folder / f'{name}.bin.{os.getpid()}.tmp'
    self._file = open(self._tmp, 'wb')
    self._hash = hashlib.sha256()
    self._ends = [0]

  def append(self, docs) -> None:
    """Appends documents, each a 1-D int array of token ids that already ends with its EOS."""
    if not docs:
      return
    data = np.concatenate(docs).astype(self.dtype).tobytes()
    self._file.write(data)
    self._hash.update(data)
    self._ends.extend((self._ends[-1] + np.cumsum([len(d) for d in docs])).tolist())

  @property
  def docs(self) -> int:
    return len(self._ends) - 1

  def close(self) -> dict:
    self._file.close()
    size = self._ends[-1] * self.dtype.itemsize
    index = np.asarray(self._ends, dtype='<i8').tobytes()
    tmp_index = self.folder / f'{self.name}.idx.{os.getpid()}.tmp'
    tmp_index.write_bytes(index)
    os.replace(tmp_index, self.folder / f'{self.name}.idx')
    os.replace(self._tmp, self.folder / f'{self.name}.bin')
    return {
      'file': f'{SHARDS_DIR}/{self.name}.bin',
      'index': f'{SHARDS_DIR}/{self.name}.idx',
      'docs': self.docs,
      'tokens': self._ends[-1],
      'bytes': size,
      'sha256': self._hash.hexdigest(),
      'edge_sha256': edge_sha256(self.folder / f'{self.name}.bin', size),
      'index_sha256': hashlib.sha256(index).hexdigest(),
    }

  def discard(self) -> None:
    self._file.close()
    self._tmp.unlink(missing_ok=True)


def write_shard(directory: pathlib.Path, name: str, tokens: np.ndarray, offsets: np.ndarray) -> dict:
  """Writes the shard NAME of `tokens` (in the corpus dtype) whose documents end at `offsets[1:]`
  (int64 [docs + 1], offsets[0] = 0); returns its manifest record."""
  writer = ShardWriter(directory, name, tokens.dtype)
  offsets = np.asarray(offsets, dtype=np.int64)
  writer.append([tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])])
  return writer.close()


def read_manifest(path: str | pathlib.Path) -> dict:
  """The manifest of the shards in `path` (data.path); DataError when there is none or it is not one."""
  root = pathlib.Path(str(path)).expanduser()
  if not str(path):
    raise DataError(
      "data.path is empty; data.source='shards' needs data.path set to a folder written by "
      'python -m kimijax.data.prepare'
    )
  if not root.is_dir():
    raise DataError(
      f"data.path={str(path)!r} does not exist (data.source='shards' reads a folder written "
      'by python -m kimijax.data.prepare)'
    )
  manifest = root / 'manifest.json'
  if not manifest.is_file():
    hint = (
      ' its preparation is unfinished: re-run the same python -m kimijax.data.prepare command to resume it'
      if (root / 'plan.json').is_file()
      else ' it was not written by python -m kimijax.data.prepare'
    )
    raise DataError(f'data.path={str(path)!r} has no manifest.json:{hint}')
  try:
    data = json.loads(manifest.read_text())
  except ValueError as e:
    raise DataError(f'{manifest} is not valid JSON ({e})') from None
  if data.get('format') != FORMAT or data.get('version') != VERSION:
    raise DataError(f'{manifest} is not a {FORMAT} v{VERSION} manifest')
  return data


def check_tokenizer(path, manifest: dict, tokenizer) -> None:
  """DataError unless the shards were written with `tokenizer` (same fingerprint)."""
  written = manifest['tokenizer']
  if written['fingerprint'] == tokenizer.fingerprint:
    return
  spec = written['spec']
  if written.get('file_in_dir'):
    spec = 'hf:' + str(pathlib.Path(str(path)) / written['file_in_dir'])
  raise DataError(
    f'data.path={str(path)!r} holds shards written with tokenizer {spec!r} (fingerprint '
    f'{written["fingerprint"][:12]}), but data.tokenizer={tokenizer.spec!r} has fingerprint '
    f'{tokenizer.fingerprint[:12]}; set data.tokenizer={spec!r}'
  )


def check_shard(root: pathlib.Path, record: dict) -> None:
  """DataError naming the shard when its size or edge hash differs from its manifest record."""
  path = root / record['file']
  if not path.is_file():
    raise DataError(f'shard {path} of the manifest is missing')
  size = path.stat().st_size
  if size != record['bytes']:
    raise DataError(
      f'shard {path} is {size:,} bytes, the manifest says {record["bytes"]:,} (truncated or '
      're-written); re-run python -m kimijax.data.prepare into a new folder'
    )
  if edge_sha256(path, size) != record['edge_sha256']:
    raise DataError(
      f"shard {path} is corrupt: its first/last {EDGE_BYTES} bytes do not match the manifest's "
      'checksum; re-run python -m kimijax.data.prepare into a new folder'
    )
  index = root / record['index']
  if not index.is_file() or index.stat().st_size != 8 * (record['docs'] + 1):
    raise DataError(f'shard index {index} is missing or not {8 * (record["docs"] + 1):,} bytes as the manifest says')


class ShardSplit:
  """The tokens of one split as one stream of `len(self)` tokens (the shards in manifest order).

  `read(start, n)` -> int32 [n]: tokens [start, start + n), across shard boundaries; `read_rows(starts,
  n)` -> int32 [R, n], one positional read per row (two where a row crosses into the next shard).
  Thread-safe; keeps at most MAX_OPEN_FILES shards open; picklable (files reopen on use)."""

  def __init__(self, root: pathlib.Path, records: list[dict], dtype: str):
    self.root = pathlib.Path(root)
    self.records = [r for r in records if r['tokens']]
    self.dtype = np.dtype(dtype).newbyteorder('<')
    self.starts = np.cumsum([0] + [r['tokens'] for r in self.records], dtype=np.int64)
    self._open = collections.OrderedDict()
    self._lock = threading.Lock()
    self.max_read_bytes = 0  # the largest single read so far (tests bound it)

  def __len__(self) -> int:
    return int(self.starts[-1])

  def __getstate__(self):
    state = dict(self.__dict__)
    state['_open'], state['_lock'] = None, None
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._open, self._lock = collections.OrderedDict(), threading.Lock()

  def _fd(self, shard: int) -> int:
    """An open descriptor of `shard` (call with the lock held: an evicted one is closed here)."""
    fd = self._open.pop(shard, None)
    if fd is None:
      fd = os.open(self.root / self.records[shard]['file'], os.O_RDONLY)
      if len(self._open) >= MAX_OPEN_FILES:
        os.close(self._open.popitem(last=False)[1])
    self._open[shard] = fd
    return fd

  def _read_into(self, buf: np.ndarray, start: int) -> None:
    """Fills the 1-D array `buf` (this split's dtype) with tokens [start, start + len(buf)); with the
    lock held."""
    shard = int(np.searchsorted(self.starts, start, side='right')) - 1
    done, n = 0, len(buf)
    while done < n:
      offset = start + done - int(self.starts[shard])
      count = min(n - done, int(self.starts[shard + 1]) - (start + done))
      part = buf[done : done + count]
      got = os.preadv(self._fd(shard), [part], offset * self.dtype.itemsize)
      if got != part.nbytes:
        raise DataError(f'shard {self.root / self.records[shard]["file"]} ended early (truncated while reading)')
      self.max_read_bytes = max(self.max_read_bytes, part.nbytes)
      done += count
      shard += 1

  def read_rows(self, starts, n: int) -> np.ndarray:
    """int32 [len(starts), n]: row r holds tokens [starts[r], starts[r] + n)."""
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if len(starts) and (starts.min() < 0 or starts.max() + n > len(self)):
      raise IndexError(
        f'rows of {n} tokens from {starts.min()} to {starts.max()} exceed the split of {len(self)} tokens'
      )
    buf = np.empty((len(starts), n), dtype=self.dtype)
    with self._lock:  # one batch at a time: an evicted descriptor is never read after its close
      for r, start in enumerate(starts.tolist()):
        self._read_into(buf[r], start)
    return buf.astype(np.int32)

  def read(self, start: int, n: int) -> np.ndarray:
    """int32 [n]: tokens [start, start + n)."""
    return self.read_rows([start], n)[0]

  def document_offsets(self) -> np.ndarray:
    """int64 [docs + 1]: the split's document boundaries in stream positions (reads every index)."""
    parts = [np.zeros(1, np.int64)]
    for start, r in zip(self.starts[:-1], self.records):
      parts.append(np.fromfile(self.root / r['index'], dtype='<i8')[1:] + start)
    return np.concatenate(parts)

  def close(self) -> None:
    with self._lock:
      while self._open:
        os.close(self._open.popitem()[1])


@functools.lru_cache(maxsize=8)
def _checked_split(path: str, split: str) -> ShardSplit:
  manifest, root = read_manifest(path), pathlib.Path(path).expanduser()
  if split not in manifest['splits']:
    raise DataError(f'data.path={path!r}: the manifest has no {split!r} split')
  records = manifest['splits'][split]['shards']
  for record in records:
    check_shard(root, record)
  return ShardSplit(root, records, manifest['dtype'])


def open_split(path: str, split: str, tokenizer) -> ShardSplit:
  """The stream of `split` of the shards at data.path `path`, checked against the manifest and
  against `tokenizer` (the shards' checks are cached per process)."""
  check_tokenizer(path, read_manifest(path), tokenizer)
  return _checked_split(str(path), split)


def verify_split(path: str, split: str) -> None:
  """Reads every byte of the split's shards and indices against the manifest's SHA-256s."""
  manifest, root = read_manifest(path), pathlib.Path(path).expanduser()
  for record in manifest['splits'][split]['shards']:
    check_shard(root, record)
    for key, digest in (('file', 'sha256'), ('index', 'index_sha256')):
      if file_sha256(root / record[key]) != record[digest]:
        raise DataError(f"shard file {root / record[key]} is corrupt: its SHA-256 differs from the manifest's")
