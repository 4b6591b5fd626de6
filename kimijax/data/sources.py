"""Raw text corpora: the embedded Python stdlib corpus and user text files.

Every source returns a list of documents (`bytes`) for one split. Splits are
made by file with a stable hash, so they never change between runs/machines.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from typing import Sequence

SPLITS = ('train', 'validation')

# Directories skipped in the stdlib corpus: installed packages and caches (not
# the stdlib), test suites and IDLE (large, less code-like), and pydoc_data
# (one ~0.8 MB .py file of English help text).
STDLIB_EXCLUDED_DIRS = frozenset({
    'site-packages', 'dist-packages', '__pycache__', 'test', 'tests',
    'idlelib', 'pydoc_data',
})


class DataError(ValueError):
  """A data configuration problem, detected before any compute starts."""


def _check_split(split: str, val_fraction: float) -> None:
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if not 0.0 < val_fraction < 1.0:
    raise DataError(
        f'data.val_fraction must be in (0, 1), got {val_fraction!r}'
    )


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()['stdlib'])


def stdlib_files() -> list[pathlib.Path]:
  """All `.py` files of the Python stdlib (minus STDLIB_EXCLUDED_DIRS).

  Sorted by path relative to the stdlib root.
  """
  root = stdlib_root()
  files = [
      p
      for p in root.rglob('*.py')
      if p.is_file()
      and not STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
  ]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _hash_unit(rel_path: str) -> float:
  """Stable hash of a relative path, mapped to [0, 1)."""
  digest = hashlib.sha256(rel_path.encode('utf-8')).digest()
  return int.from_bytes(digest[:8], 'big') / 2**64


def split_files(
    paths: Sequence[pathlib.Path],
    root: pathlib.Path,
    split: str,
    val_fraction: float,
) -> list[pathlib.Path]:
  """Files of `split`, chosen by a stable hash of the path relative to `root`.

  A file goes to validation iff hash < val_fraction. With >= 2 files each split
  gets at least one: the lowest-hash file is forced into validation, or the
  highest-hash file into train. Keeps the input order.
  """
  _check_split(split, val_fraction)
  root = pathlib.Path(root)
  paths = [pathlib.Path(p) for p in paths]
  h = [_hash_unit(p.relative_to(root).as_posix()) for p in paths]
  is_val = [x < val_fraction for x in h]
  if len(paths) >= 2:
    if not any(is_val):
      is_val[min(range(len(h)), key=h.__getitem__)] = True
    elif all(is_val):
      is_val[max(range(len(h)), key=h.__getitem__)] = False
  want_val = split == 'validation'
  return [p for p, v in zip(paths, is_val) if v == want_val]


def _list_text_files(root: pathlib.Path) -> list[pathlib.Path]:
  """Regular, non-hidden files under `root` (recursively), sorted."""
  files = [
      p
      for p in root.rglob('*')
      if p.is_file()
      and not any(part.startswith('.') for part in p.relative_to(root).parts)
  ]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def text_documents(path: str, split: str, val_fraction: float) -> list[bytes]:
  """Documents of `split` from `data.path` (a file or a folder).

  Folder with >= 2 files: one document per file, split by file. Single file:
  one document, the last `val_fraction` of its bytes is validation.
  """
  _check_split(split, val_fraction)
  if not path:
    raise DataError(
        "data.path is empty; data.source='text' needs data.path set to a text"
        ' file or a folder of text files'
    )
  root = pathlib.Path(path).expanduser()
  if root.is_file():
    files = [root]
  elif root.is_dir():
    files = _list_text_files(root)
  else:
    raise DataError(f'data.path={path!r} does not exist')
  if not files or all(f.stat().st_size == 0 for f in files):
    raise DataError(
        f'data.path={path!r} has no data (no non-hidden, non-empty files)'
    )
  if len(files) == 1:
    data = files[0].read_bytes()
    cut = len(data) - max(1, int(len(data) * val_fraction))
    doc = data[:cut] if split == 'train' else data[cut:]
    return [doc] if doc else []
  docs = (f.read_bytes() for f in split_files(files, root, split, val_fraction))
  return [d for d in docs if d]


def stdlib_documents(split: str, val_fraction: float) -> list[bytes]:
  """Documents (one per `.py` file) of `split` of the embedded stdlib corpus."""
  files = stdlib_files()
  if not files:
    raise DataError(
        f'no .py files found under the Python stdlib at {stdlib_root()}; set'
        " data.source='text' and data.path instead"
    )
  chosen = split_files(files, stdlib_root(), split, val_fraction)
  return [d for d in (f.read_bytes() for f in chosen) if d]
