"""The text source keeps only UTF-8 text files (a folder of images or __pycache__ does not train
silently), stops with a clear error when nothing is left, and the start-up report gives files and
bytes per split for each source."""

import pathlib
import struct
import zlib

import pytest

from kimijax.data import DataError, text_documents
from kimijax.data.sources import corpus_report, is_text_file, split_files

PNG = b'\x89PNG\r\n\x1a\n' + struct.pack('>I', 13) + b'IHDR' + bytes(13) + zlib.compress(bytes(300))
PYC = b'\xcb\r\r\n' + bytes(12) + b'\xe3\x00\x00\x00' + bytes(40)


def _folder(tmp_path: pathlib.Path) -> dict[str, bytes]:
  files = {f'src/mod_{i}.py': f'def f_{i}(x):\n  return x * {i}  # caf\u00e9\n'.encode() * (i + 1) for i in range(8)}
  files.update(
    {
      'img/a.png': PNG,
      'img/b.png': PNG,
      'src/__pycache__/mod_0.cpython-312.pyc': PYC,
      'notes.txt': 'plain text \u2014 with a dash\n'.encode(),
    }
  )
  for name, data in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(data)
  return files


def test_sniffing_tells_text_from_binary(tmp_path):
  for name, data, want in [
    ('a.txt', 'h\u00e9llo'.encode(), True),
    ('b.png', PNG, False),
    ('c.pyc', PYC, False),
    ('d.bin', b'\xff\xfe\xfa' * 10, False),
    ('e.txt', b'x' * 8191 + '\u00e9'.encode(), True),
  ]:
    (tmp_path / name).write_bytes(data)
    assert is_text_file(tmp_path / name) is want, name


def test_folder_trains_on_text_files_only(tmp_path):
  files = _folder(tmp_path)
  text = {n: d for n, d in files.items() if not n.endswith(('.png', '.pyc'))}
  docs = text_documents(str(tmp_path), 'train', 0.2) + text_documents(str(tmp_path), 'validation', 0.2)
  assert sorted(docs) == sorted(text.values())


def test_report_counts_files_and_bytes_per_split_and_the_skipped_kinds(tmp_path):
  files = _folder(tmp_path)
  lines = corpus_report('text', str(tmp_path), 0.2)
  text_paths = sorted(tmp_path / n for n in files if not n.endswith(('.png', '.pyc')))
  for split, line in zip(('train', 'validation'), lines[1:3]):
    chosen = split_files(text_paths, tmp_path, split, 0.2)
    assert line.split() == [
      split,
      f'{len(chosen):,}',
      'files',
      f'{sum(len(files[p.relative_to(tmp_path).as_posix()]) for p in chosen):,}',
      'bytes',
    ]
  assert 'skipped 3 files that are not text (2 .png, 1 .pyc)' in lines[3]


def test_nothing_but_binary_files_is_an_error_naming_the_kinds(tmp_path):
  for i in range(3):
    (tmp_path / f'{i}.png').write_bytes(PNG)
  (tmp_path / 'x.pyc').write_bytes(PYC)
  with pytest.raises(
    DataError, match=r'has no text files: all 4 non-empty files are not UTF-8 text \(3 \.png, 1 \.pyc\)'
  ):
    text_documents(str(tmp_path), 'train', 0.1)


def test_report_for_stdlib_and_synthetic_sources():
  lines = corpus_report('stdlib', '', 0.05)
  assert lines[0].startswith('data: stdlib')
  n_train, n_val = (int(l.split()[1].replace(',', '')) for l in lines[1:3])
  assert n_train > 100 and n_val > 5
  assert 'synthetic' in corpus_report('mqar', '', 0.05)[0]


def test_report_for_site_packages_counts_distinct_files(tmp_path, monkeypatch):
  from kimijax.data import site_packages

  contents = [f'x_{i} = {i}\n'.encode() * (i + 1) for i in range(6)]
  for i, data in enumerate(contents):
    (tmp_path / f'm{i}.py').write_bytes(data)
  (tmp_path / 'copy_of_m0.py').write_bytes(contents[0])  # a duplicate is one document
  monkeypatch.setattr(site_packages, 'site_packages_roots', lambda: (tmp_path.resolve(),))
  lines = corpus_report('site_packages', '', 0.3)
  assert lines[0] == f'data: site_packages ({tmp_path.resolve()})'
  splits = [l.split() for l in lines[1:3]]
  assert [s[0] for s in splits] == ['train', 'validation']
  assert sum(int(s[1]) for s in splits) == len(contents)
  assert sum(int(s[3].replace(',', '')) for s in splits) == sum(map(len, contents))
