"""A larger code corpus for scaling ladders: the Python source of every installed package.

`data.source='site_packages'` reads every `.py` file under the running interpreter's
site-packages (sysconfig's purelib and platlib, site's folders; in a virtualenv, the venv's),
several times the stdlib corpus's ~10 MB (each run prints both splits' sizes), so that a ladder's
larger rungs repeat their tokens less. Files with identical contents (vendored copies, empty `__init__.py`) count once:
documents are deduplicated by the SHA-256 of their bytes. The split is by that hash too (a
document is validation iff its hash maps below val_fraction), so a copy of a file can never sit
in both splits, and the order is by hash, so the corpus is the same whatever the install paths or
the file system's listing order. A different set of installed packages is a different corpus:
the data loader reports its size and reports give epochs per run.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import sysconfig
from collections.abc import Iterable

SKIPPED_DIRS = frozenset({'__pycache__'})


def site_packages_roots() -> tuple[pathlib.Path, ...]:
  """The running interpreter's package folders: sysconfig's purelib and platlib, site's global
  and user site-packages (dist-packages on Debian), existing ones, once each."""
  import site

  paths = sysconfig.get_paths()
  candidates = [paths['purelib'], paths['platlib'], *getattr(site, 'getsitepackages', lambda: [])()]
  if site.ENABLE_USER_SITE:
    candidates.append(site.getusersitepackages())
  roots = []
  for c in candidates:
    p = pathlib.Path(c).resolve()
    if p.is_dir() and p not in roots:
      roots.append(p)
  return tuple(roots)


def _python_files(root: pathlib.Path) -> Iterable[pathlib.Path]:
  """`.py` files under root, not following symlinked folders (no cycles, no escaping the root)."""
  for folder, dirs, files in os.walk(root, followlinks=False):
    dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
    for name in files:
      if name.endswith('.py'):
        path = pathlib.Path(folder) / name
        if path.is_file():
          yield path


def _hash_unit(digest: bytes) -> float:
  return int.from_bytes(digest[:8], 'big') / 2**64


@functools.lru_cache(maxsize=4)
def unique_sources(roots: tuple[pathlib.Path, ...]) -> tuple[tuple[bytes, bytes], ...]:
  """((sha256 digest, contents), ...) of the distinct non-empty `.py` files under roots, sorted by
  digest. Unreadable files are skipped."""
  by_digest = {}
  for root in roots:
    for path in _python_files(pathlib.Path(root)):
      try:
        data = path.read_bytes()
      except OSError:
        continue
      if data:
        by_digest.setdefault(hashlib.sha256(data).digest(), data)
  return tuple(sorted(by_digest.items()))


def split_by_hash(sources: tuple[tuple[bytes, bytes], ...], split: str, val_fraction: float) -> list[bytes]:
  """Documents of `split`: validation iff the digest maps below val_fraction. With >= 2 documents
  each split gets one at least (the lowest digest goes to validation, or the highest to train)."""
  import numpy as np

  units = np.array([_hash_unit(d) for d, _ in sources])
  is_val = units < val_fraction
  if len(units) >= 2 and not is_val.any():
    is_val[units.argmin()] = True
  if len(units) >= 2 and is_val.all():
    is_val[units.argmax()] = False
  return [data for (_, data), v in zip(sources, is_val) if bool(v) == (split == 'validation')]


def site_packages_documents(split: str, val_fraction: float, roots=None) -> list[bytes]:
  """Documents (one per distinct `.py` file) of `split` of the site-packages corpus; `roots`
  defaults to site_packages_roots()."""
  from kimijax.data.sources import DataError, _check_split

  _check_split(split, val_fraction)
  roots = site_packages_roots() if roots is None else tuple(pathlib.Path(r).resolve() for r in roots)
  sources = unique_sources(roots)
  if len(sources) < 2:
    raise DataError(
      f"data.source='site_packages' found {len(sources)} distinct .py file(s) under "
      f'{[str(r) for r in roots]}; it needs at least 2 (one per split)'
    )
  return split_by_hash(sources, split, val_fraction)
