"""kimijax/data/site_packages.py on a temporary folder: deduplication by content, a split by content
hash that never puts a copy in both splits, the same documents and order whatever the paths, and
the real corpus through the pipeline."""

import hashlib
import pathlib
import shutil

import pytest

from kimijax.data import site_packages as sp
from kimijax.data.sources import DataError


def make_tree(root: pathlib.Path, files: dict) -> pathlib.Path:
  for rel, text in files.items():
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
  return root


FILES = {f'pkg{i % 7}/mod_{i}.py': f'def f_{i}():\n  return {i}\n' for i in range(60)}
FILES.update(
  {
    'vendored/a/six.py': 'import sys\n',
    'vendored/b/six.py': 'import sys\n',  # one copy
    'pkg0/__init__.py': '',
    'pkg0/data.txt': 'not python',
    'pkg0/__pycache__/x.py': 'cached = 1\n',
  }
)


def test_dedup_skips_empty_cache_and_non_python_files(tmp_path):
  root = make_tree(tmp_path / 'site', FILES)
  sources = sp.unique_sources((root,))
  expected = {text.encode() for rel, text in FILES.items() if rel.endswith('.py') and text and '__pycache__' not in rel}
  assert len(sources) == 61 == len(expected)
  assert {data for _, data in sources} == expected
  assert all(d == hashlib.sha256(data).digest() for d, data in sources)
  assert [d for d, _ in sources] == sorted(d for d, _ in sources)


def test_split_by_content_hash_is_disjoint_complete_and_path_independent(tmp_path):
  root = make_tree(tmp_path / 'one', FILES)
  train = sp.site_packages_documents('train', 0.2, roots=[root])
  val = sp.site_packages_documents('validation', 0.2, roots=[root])
  assert not set(train) & set(val)
  assert len(train) + len(val) == 61
  for doc in val:  # the rule itself: validation iff the content's hash maps below val_fraction
    assert int.from_bytes(hashlib.sha256(doc).digest()[:8], 'big') / 2**64 < 0.2
  # Another tree with the same contents under other names and folders: same documents, same order.
  renamed = {
    f'z/{i}/{pathlib.Path(rel).name[::-1]}.py': text
    for i, (rel, text) in enumerate(reversed(FILES.items()))
    if rel.endswith('.py') and '__pycache__' not in rel
  }
  other = make_tree(tmp_path / 'two', renamed)
  assert sp.site_packages_documents('train', 0.2, roots=[other]) == train
  assert sp.site_packages_documents('validation', 0.2, roots=[other]) == val
  # Two roots holding copies of each other count each file once.
  shutil.copytree(root, tmp_path / 'three')
  both = sp.site_packages_documents('train', 0.2, roots=[root, tmp_path / 'three'])
  assert both == train


def test_too_small_and_bad_split_are_data_errors(tmp_path):
  root = make_tree(tmp_path / 'tiny', {'a.py': 'x = 1\n'})
  with pytest.raises(DataError, match='found 1 distinct .py file'):
    sp.site_packages_documents('train', 0.1, roots=[root])
  with pytest.raises(DataError, match='split must be one of'):
    sp.site_packages_documents('test', 0.1, roots=[root])
  # Each split gets a document even when the fraction would give validation none.
  two = make_tree(tmp_path / 'two', {'a.py': 'a = 1\n', 'b.py': 'b = 2\n'})
  assert len(sp.site_packages_documents('validation', 1e-9, roots=[two])) == 1


def test_the_installed_corpus_loads_through_the_pipeline():
  from kimijax.config import base_config, validate
  from kimijax.data import make_loader

  c = base_config()
  c.data.source = 'site_packages'
  c.train.batch_size, c.train.seq_len = 2, 64
  validate(c)
  loader = make_loader(c, 'train')
  batch = next(loader)
  loader.close()
  assert batch['inputs'].shape == (2, 64) and loader.num_sequences > 10_000
