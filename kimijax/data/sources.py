"""Raw text corpora: the embedded Python stdlib corpus and user text files.

Every source returns a list of documents (`bytes`) for one split. Splits are
made by file with a stable hash, so they never change between runs/machines.
"""

from __future__ import annotations

import hashlib
import pathlib
import sysconfig
from collections.abc import Sequence

SPLITS = ('train', 'validation')

# Directories skipped in the stdlib corpus: installed packages and caches (not
# the stdlib), test suites and IDLE (large, less code-like), and pydoc_data
# (one ~0.8 MB .py file of English help text).
STDLIB_EXCLUDED_DIRS = frozenset(
  {
    'site-packages',
    'dist-packages',
    '__pycache__',
    'test',
    'tests',
    'idlelib',
    'pydoc_data',
  }
)


class DataError(ValueError):
  """A data configuration problem, detected before any compute starts."""


def _check_split(split: str, val_fraction: float) -> None:
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if not 0.0 < val_fraction < 1.0:
    raise DataError(f'data.val_fraction must be in (0, 1), got {val_fraction!r}')


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
    if p.is_file() and not STDLIB_EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
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
    p for p in root.rglob('*') if p.is_file() and not any(part.startswith('.') for part in p.relative_to(root).parts)
  ]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


TEXT_SNIFF_BYTES = 8192


def is_text_file(path: pathlib.Path) -> bool:
  """True if the file's first TEXT_SNIFF_BYTES bytes are UTF-8 without NUL bytes (a multi-byte
  character cut by the end of the sample still counts as text). Images, archives, compiled
  Python (.pyc) and other binary files fail this on their first bytes."""
  with open(path, 'rb') as f:
    head = f.read(TEXT_SNIFF_BYTES)
  if b'\0' in head:
    return False
  try:
    head.decode('utf-8')
  except UnicodeDecodeError as e:
    return len(head) == TEXT_SNIFF_BYTES and e.start >= len(head) - 3 and e.reason == 'unexpected end of data'
  return True


def _kind(path: pathlib.Path) -> str:
  return path.suffix.lower() or '(no suffix)'


def _describe_kinds(skipped: list[pathlib.Path]) -> str:
  counts: dict[str, int] = {}
  for p in skipped:
    counts[_kind(p)] = counts.get(_kind(p), 0) + 1
  return ', '.join(f'{n} {kind}' for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def text_files(path: str) -> tuple[pathlib.Path, list[pathlib.Path], list[pathlib.Path]]:
  """(root, non-empty text files, skipped files that are not text) of `data.path`: a file or a
  folder (every non-hidden file under it). Raises DataError when no text is left."""
  if not path:
    raise DataError(
      "data.path is empty; data.source='text' needs data.path set to a text file or a folder of text files"
    )
  root = pathlib.Path(path).expanduser()
  if root.is_file():
    files = [root]
  elif root.is_dir():
    files = _list_text_files(root)
  else:
    raise DataError(f'data.path={path!r} does not exist')
  files = [f for f in files if f.stat().st_size > 0]
  if not files:
    raise DataError(f'data.path={path!r} has no data (no non-hidden, non-empty files)')
  is_text = {f: is_text_file(f) for f in files}
  text = [f for f in files if is_text[f]]
  skipped = [f for f in files if not is_text[f]]
  if not text:
    raise DataError(
      f'data.path={path!r} has no text files: all {len(skipped)} non-empty files are '
      f'not UTF-8 text ({_describe_kinds(skipped)})'
    )
  return (root if root.is_dir() else root.parent), text, skipped


def corpus_report(source: str, path: str, val_fraction: float) -> list[str]:
  """Start-up lines: files and bytes of each split (and the files skipped as not text)."""
  if source == 'stdlib':
    root, files, skipped = stdlib_root(), stdlib_files(), []
    where = f'stdlib ({root})'
  elif source == 'text':
    root, files, skipped = text_files(path)
    where = f'text ({path})'
  elif source == 'site_packages':
    return _site_packages_report(val_fraction)
  else:
    return [f'data: {source} (synthetic, generated per batch; no files)']
  lines = [f'data: {where}']
  for split in SPLITS:
    if len(files) == 1:
      size = files[0].stat().st_size
      val = max(1, int(size * val_fraction))
      n_files, n_bytes = 1, (size - val if split == 'train' else val)
    else:
      sizes = [f.stat().st_size for f in split_files(files, root, split, val_fraction)]
      n_files, n_bytes = sum(1 for n in sizes if n), sum(sizes)  # empty files are no documents
    lines.append(f'  {split:<10} {n_files:>6,} files  {n_bytes:>14,} bytes')
  if skipped:
    lines.append(
      f'  skipped {len(skipped):,} files that are not text ({_describe_kinds(skipped)}), e.g. '
      f'{skipped[0].relative_to(root) if skipped[0].is_relative_to(root) else skipped[0]}'
    )
  return lines


def _site_packages_report(val_fraction: float) -> list[str]:
  """corpus_report of data.source='site_packages': its roots, and each split's distinct files and bytes."""
  from kimijax.data.site_packages import site_packages_documents, site_packages_roots

  lines = [f'data: site_packages ({", ".join(str(r) for r in site_packages_roots())})']
  for split in SPLITS:
    docs = site_packages_documents(split, val_fraction)
    lines.append(f'  {split:<10} {len(docs):>6,} files  {sum(map(len, docs)):>14,} bytes')
  return lines


def text_documents(path: str, split: str, val_fraction: float) -> list[bytes]:
  """Documents of `split` from `data.path` (a file or a folder).

  Folder with >= 2 text files: one document per file, split by file. Single file:
  one document, the last `val_fraction` of its bytes is validation. Files that are
  not UTF-8 text (is_text_file) are skipped; none left is a DataError.
  """
  _check_split(split, val_fraction)
  root, files, _ = text_files(path)  # files that are not text are skipped (corpus_report)
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
      f"no .py files found under the Python stdlib at {stdlib_root()}; set data.source='text' and data.path instead"
    )
  chosen = split_files(files, stdlib_root(), split, val_fraction)
  return [d for d in (f.read_bytes() for f in chosen) if d]
