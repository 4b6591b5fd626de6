"""Input corpora of `kimijax.data.prepare`: which files, in which pieces, and their documents.

Files by name (compression by a .gz / .zst suffix):
  *.jsonl, *.ndjson (+ .gz / .zst)   one document per line: the string field `text_field` of a JSON object
  *.parquet                          one document per row: the string column `text_field` (FineWeb: 'text')
  any other file                     one document: the whole file, if it is UTF-8 text (is_text_file);
                                     files that are not text are skipped and reported
Hidden files and folders (a name starting with '.') under a folder are skipped; empty files too.

A piece is a part of one file that one worker reads: a byte range of an uncompressed JSONL file (a
line belongs to the range holding its first byte), a range of a parquet file's row groups, or a
whole file. Pieces are grouped into units of about `unit_bytes` input bytes, in the sorted order of
the files' resolved paths, so the same files always give the same units whatever the order of the
--input arguments.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import io
import json
import os
import pathlib
from collections.abc import Iterator

from kimijax.data.sources import DataError, is_text_file

JSONL_SUFFIXES = ('.jsonl', '.ndjson')
COMPRESSION = ('.gz', '.zst')


@dataclasses.dataclass(frozen=True)
class Piece:
  """Part of one input file: [start, stop) bytes (plain JSONL), row groups (parquet), or the whole
  file (start=0, stop=-1). `nbytes`: its share of the file's bytes on disk."""

  path: str
  kind: str  # 'jsonl', 'parquet' or 'text'
  start: int
  stop: int
  nbytes: int


def input_kind(path: pathlib.Path) -> str:
  """'jsonl', 'parquet' or 'text' by the file name."""
  name = path.name.lower()
  for c in COMPRESSION:
    if name.endswith(c):
      name = name[: -len(c)]
      break
  if name.endswith(JSONL_SUFFIXES):
    return 'jsonl'
  if name.endswith('.parquet'):
    return 'parquet'
  return 'text'


def _hidden(path: pathlib.Path, root: pathlib.Path) -> bool:
  return any(part.startswith('.') for part in path.relative_to(root).parts)


def expand_inputs(patterns) -> list[pathlib.Path]:
  """The files named by --input values (files, folders searched recursively, or globs with * ? [ ]
  and ** across folders): resolved, deduplicated, sorted by path. Raises DataError for a value that
  names nothing."""
  found = set()
  for pattern in patterns:
    pattern = os.path.expanduser(str(pattern))
    if any(c in pattern for c in '*?['):
      matches = [pathlib.Path(m) for m in glob.glob(pattern, recursive=True)]
      matches = [m for m in matches if m.is_file()] + [
        f for m in matches if m.is_dir() for f in m.rglob('*') if f.is_file() and not _hidden(f, m)
      ]
    else:
      p = pathlib.Path(pattern)
      if p.is_file():
        matches = [p]
      elif p.is_dir():
        matches = [f for f in p.rglob('*') if f.is_file() and not _hidden(f, p)]
      else:
        raise DataError(f'--input={pattern} does not exist')
    if not matches:
      raise DataError(f'--input={pattern} matches no file')
    found.update(m.resolve() for m in matches)
  return sorted(found, key=str)


def _open_binary(path: pathlib.Path):
  """A binary stream of the decompressed bytes of `path`."""
  name = path.name.lower()
  if name.endswith('.gz'):
    return gzip.open(path, 'rb')
  if name.endswith('.zst'):
    import zstandard

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, 'rb'), closefd=True))
  return open(path, 'rb')


def _jsonl_text(line: bytes, field: str, path, where: str) -> str | None:
  try:
    record = json.loads(line)
  except ValueError as e:
    raise DataError(f'{path} ({where}) is not a JSON line ({e})') from None
  if not isinstance(record, dict) or field not in record:
    keys = sorted(record)[:8] if isinstance(record, dict) else type(record).__name__
    raise DataError(f'{path} ({where}) has no field {field!r} (it has {keys}); set --text_field')
  text = record[field]
  if text is None:
    return None
  if not isinstance(text, str):
    raise DataError(f'{path} ({where}): field {field!r} is a {type(text).__name__}, not a string')
  return text


def check_file(path: pathlib.Path, kind: str, field: str) -> bool:
  """Cheap checks before any compute: a JSONL file's first record has `field`, a parquet file has a
  string column `field`, a text file is UTF-8 text. Returns False for a file to skip (not text),
  raises DataError for a file that cannot be read as its kind."""
  if kind == 'text':
    return is_text_file(path)
  if kind == 'jsonl':
    try:
      with _open_binary(path) as f:
        for lineno, line in enumerate(f, 1):
          if line.strip():
            _jsonl_text(line, field, path, f'line {lineno}')
            break
    except (OSError, EOFError) as e:
      raise DataError(f'{path} cannot be read ({e})') from None
    return True
  import pyarrow as pa
  import pyarrow.parquet as pq

  try:
    schema = pq.read_schema(path)
  except (OSError, pa.ArrowException) as e:
    raise DataError(f'{path} is not a parquet file ({" ".join(str(e).split())[:160]})') from None
  if field not in schema.names:
    raise DataError(f'{path} has no column {field!r} (columns: {schema.names[:8]}); set --text_field')
  if not (pa.types.is_string(schema.field(field).type) or pa.types.is_large_string(schema.field(field).type)):
    raise DataError(f'{path}: column {field!r} is {schema.field(field).type}, not a string column')
  return True


def file_pieces(path: pathlib.Path, kind: str, size: int, unit_bytes: int) -> list[Piece]:
  """The pieces of one file of `size` bytes, each about `unit_bytes` or less where the file splits."""
  if kind == 'jsonl' and not path.name.lower().endswith(COMPRESSION) and size > unit_bytes:
    bounds = list(range(0, size, unit_bytes)) + [size]
    return [Piece(str(path), kind, a, b, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
  if kind == 'parquet':
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(path).metadata
    weights = [max(1, meta.row_group(i).total_byte_size) for i in range(meta.num_row_groups)]
    total = sum(weights) or 1
    pieces, first, acc = [], 0, 0
    for i, w in enumerate(weights):
      acc += w
      if acc * size >= unit_bytes * total or i == len(weights) - 1:
        pieces.append(Piece(str(path), kind, first, i + 1, round(size * acc / total)))
        first, acc = i + 1, 0
    return pieces
  return [Piece(str(path), kind, 0, -1, size)]


def group_units(pieces: list[Piece], unit_bytes: int) -> list[list[Piece]]:
  """Consecutive pieces grouped into units of at least `unit_bytes` (the last may be smaller)."""
  units, current, acc = [], [], 0
  for piece in pieces:
    current.append(piece)
    acc += piece.nbytes
    if acc >= unit_bytes:
      units.append(current)
      current, acc = [], 0
  if current:
    units.append(current)
  return units


def _read_errors() -> tuple[type[BaseException], ...]:
  """What reading a damaged or unreadable input raises: I/O errors, a truncated .gz (EOFError),
  zstandard's and pyarrow's own errors (imported here, where they are installed)."""
  errors: list[type[BaseException]] = [OSError, EOFError, ValueError]
  try:
    import zstandard

    errors.append(zstandard.ZstdError)
  except ImportError:
    pass
  try:
    import pyarrow as pa

    errors.append(pa.ArrowException)
  except ImportError:
    pass
  return tuple(errors)


def read_documents(piece: Piece, field: str) -> Iterator[str | bytes]:
  """The documents of `piece` in file order: str (JSONL, parquet) or bytes (text files). Null
  values are skipped; a record without the field, or a file that fails while it is read (a
  truncated .gz, an I/O error), is a DataError naming the file."""
  try:
    yield from _documents(piece, field)
  except DataError:
    raise
  except _read_errors() as e:
    raise DataError(f'{piece.path} cannot be read ({type(e).__name__}: {" ".join(str(e).split())[:200]})') from None


def _documents(piece: Piece, field: str) -> Iterator[str | bytes]:
  path = pathlib.Path(piece.path)
  if piece.kind == 'text':
    yield path.read_bytes()
  elif piece.kind == 'jsonl':
    with _open_binary(path) as f:
      if piece.stop < 0 or path.name.lower().endswith(COMPRESSION):
        for lineno, line in enumerate(f, 1):
          if line.strip():
            text = _jsonl_text(line, field, path, f'line {lineno}')
            if text is not None:
              yield text
        return
      if piece.start > 0:
        f.seek(piece.start - 1)
        f.readline()  # the rest of the line that holds byte start - 1
      while f.tell() < piece.stop:
        at = f.tell()
        line = f.readline()
        if not line:
          break
        if line.strip():
          text = _jsonl_text(line, field, path, f'the line at byte {at}')
          if text is not None:
            yield text
  else:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    for i in range(piece.start, piece.stop):
      for text in pf.read_row_group(i, columns=[field]).column(0).to_pylist():
        if text is not None:
          yield text
