"""Tests for kimijax.data (CPU only, fast)."""

import json
import pathlib
import sysconfig

import ml_collections
import numpy as np
import pytest

from kimijax.data import (
  EOS_ID,
  PAD_ID,
  ByteTokenizer,
  DataError,
  default_data_config,
  eval_batches,
  make_loader,
  mqar_batch,
  pack_documents,
  split_files,
  stdlib_documents,
  stdlib_files,
)


def make_config(batch_size=4, seq_len=8, seed=0, **data):
  c = ml_collections.ConfigDict()
  c.seed = seed
  c.train = ml_collections.ConfigDict({'batch_size': batch_size, 'seq_len': seq_len})
  c.data = default_data_config()
  c.data.update(data)
  return c


def write_files(root: pathlib.Path, files: dict) -> pathlib.Path:
  for name, content in files.items():
    p = root / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(content)
  return root


def take(loader, n):
  return [next(loader) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


@pytest.fixture
def corpus(tmp_path):
  """Folder of 12 small text files (+ hidden ones that must be ignored)."""
  files = {f'd{i % 3}/f{i:02d}.txt': bytes(f'file {i}: ' + 'xyz' * (40 + 5 * i), 'utf-8') for i in range(12)}
  files['.hidden'] = b'HIDDEN'
  files['.git/config'] = b'HIDDEN'
  return write_files(tmp_path / 'corpus', files)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip():
  tok = ByteTokenizer()
  assert (tok.vocab_size, EOS_ID, PAD_ID) == (258, 256, 257)
  ids = tok.encode('hé!')
  assert ids.dtype == np.int32
  assert ids.tolist() == [104, 0xC3, 0xA9, 33]
  assert tok.encode(b'\x00\xff').tolist() == [0, 255]
  text = 'def f(x):\n    return x  # ünïcödé ✓'
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode([104, EOS_ID, 105, PAD_ID]) == 'hi'
  assert tok.decode([0xC3]) == '\ufffd'  # invalid utf-8 is replaced


# ---------------------------------------------------------------- sources


def test_split_files_deterministic_disjoint_covering(tmp_path):
  root = tmp_path / 'a'
  paths = [root / f'sub/{i:03d}.py' for i in range(200)]
  train = split_files(paths, root, 'train', 0.1)
  val = split_files(paths, root, 'validation', 0.1)
  assert train == split_files(paths, root, 'train', 0.1)
  assert not set(train) & set(val)
  assert sorted(train + val) == sorted(paths)
  assert 5 <= len(val) <= 40  # ~10% of 200
  # Stable: depends only on the path relative to root.
  other = tmp_path / 'b'
  moved = split_files([other / p.relative_to(root) for p in paths], other, 'validation', 0.1)
  assert [p.relative_to(other) for p in moved] == [p.relative_to(root) for p in val]


@pytest.mark.parametrize('val_fraction', [1e-6, 0.999999])
def test_split_files_both_splits_nonempty(tmp_path, val_fraction):
  paths = [tmp_path / 'x.txt', tmp_path / 'y.txt']
  train = split_files(paths, tmp_path, 'train', val_fraction)
  val = split_files(paths, tmp_path, 'validation', val_fraction)
  assert len(train) == len(val) == 1 and set(train + val) == set(paths)


def test_stdlib_corpus_exists_with_both_splits():
  files = stdlib_files()
  assert len(files) > 100
  assert all(f.suffix == '.py' for f in files)
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  for f in files:
    assert not {'site-packages', '__pycache__', 'test', 'tests'} & set(f.relative_to(root).parts)
  assert any(f.name == 'functools.py' for f in files)
  train, val = stdlib_documents('train', 0.05), stdlib_documents('validation', 0.05)
  assert len(train) > len(val) > 0
  assert len(train) + len(val) == sum(1 for f in files if f.stat().st_size > 0)


# ---------------------------------------------------------------- packing


def test_pack_documents():
  assert pack_documents([b'ab', b'c']).tolist() == [97, 98, EOS_ID, 99, EOS_ID]


def test_single_file_windows_by_hand(tmp_path):
  path = tmp_path / 'one.txt'
  path.write_bytes(b'0123456789')  # val_fraction 0.2 -> train '01234567', val '89'
  cfg = make_config(batch_size=4, seq_len=2, source='text', path=str(path), val_fraction=0.2)
  # Train stream: 0 1 2 3 4 5 6 7 EOS -> 4 windows of 3 tokens, stride 2.
  d = [ord(c) for c in '01234567'] + [EOS_ID]
  windows = sorted([d[0:3], d[2:5], d[4:7], d[6:9]])
  loader = make_loader(cfg, 'train')
  assert loader.num_sequences == 4 and loader.tokens_per_batch == 8
  for batch in take(loader, 3):  # every batch here is one full (shuffled) epoch
    assert batch['inputs'].dtype == batch['targets'].dtype == np.int32
    assert batch['mask'].dtype == np.float32 and batch['mask'].shape == (4, 2)
    assert np.all(batch['mask'] == 1)
    got = np.concatenate([batch['inputs'], batch['targets'][:, -1:]], axis=1)
    assert sorted(got.tolist()) == windows
    np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
  # Validation stream: 8 9 EOS -> one window, repeated.
  val = eval_batches(make_config(batch_size=1, seq_len=2, source='text', path=str(path), val_fraction=0.2), 3)
  for batch in val:
    assert batch['inputs'].tolist() == [[ord('8'), ord('9')]]
    assert batch['targets'].tolist() == [[ord('9'), EOS_ID]]


def test_folder_validation_windows_by_hand(corpus):
  cfg = make_config(batch_size=2, seq_len=5, source='text', path=str(corpus), val_fraction=0.3)
  all_files = sorted(p for p in corpus.rglob('*.txt'))
  val_files = split_files(all_files, corpus, 'validation', 0.3)
  stream = []
  for f in val_files:  # sorted by relative path, EOS after each document
    stream += list(f.read_bytes()) + [EOS_ID]
  n = (len(stream) - 1) // 5
  windows = [stream[i * 5 : i * 5 + 6] for i in range(n)]
  batches = eval_batches(cfg, 2 * n)  # wraps around the split twice over
  rows = [np.concatenate([b['inputs'], b['targets'][:, -1:]], 1) for b in batches]
  rows = np.concatenate(rows).tolist()
  assert rows == (windows * 4)[: 4 * n]
  assert EOS_ID in stream and b'HIDDEN' not in bytes(x for x in stream if x < 256)
  assert_batches_equal(batches, eval_batches(cfg, 2 * n))  # same every call


def test_train_split_excludes_validation_files(corpus):
  cfg = make_config(batch_size=2, seq_len=4, source='text', path=str(corpus), val_fraction=0.3)
  val_files = split_files(sorted(corpus.rglob('*.txt')), corpus, 'validation', 0.3)
  loader = make_loader(cfg, 'train')
  seen = b''.join(bytes(x for x in b['inputs'].ravel() if x < 256) for b in take(loader, 40))
  for f in val_files:
    assert f.read_bytes()[:9] not in seen  # the 'file N: ' header is unique


# ---------------------------------------------------------------- sharding / state


@pytest.mark.parametrize('source', ['text', 'mqar', 'stdlib'])
def test_two_processes_see_the_one_process_batch(corpus, source):
  cfg = make_config(batch_size=4, seq_len=64, source=source, path=str(corpus), mqar_num_pairs=4)
  one = take(make_loader(cfg, 'train'), 12)
  p0 = take(make_loader(cfg, 'train', process_index=0, process_count=2), 12)
  p1 = take(make_loader(cfg, 'train', process_index=1, process_count=2), 12)
  for full, a, b in zip(one, p0, p1):
    assert a['inputs'].shape == (2, 64)
    for k in full:
      np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), full[k])
  cfg.train.seq_len = 16  # the validation split of `corpus` is small
  ev = eval_batches(cfg, 9)
  ev0 = eval_batches(cfg, 9, process_index=0, process_count=2)
  ev1 = eval_batches(cfg, 9, process_index=1, process_count=2)
  for full, a, b in zip(ev, ev0, ev1):
    np.testing.assert_array_equal(np.concatenate([a['inputs'], b['inputs']]), full['inputs'])


@pytest.mark.parametrize('source', ['text', 'mqar'])
def test_get_state_set_state_resumes(corpus, source):
  cfg = make_config(batch_size=4, seq_len=64, source=source, path=str(corpus), mqar_num_pairs=2)
  reference = take(make_loader(cfg, 'train'), 30)
  if source == 'text':  # the 120 rows span several epochs
    assert make_loader(cfg, 'train').num_sequences < 40
  first = make_loader(cfg, 'train')
  take(first, 11)
  state = json.loads(json.dumps(first.get_state()))
  resumed = make_loader(cfg, 'train')
  take(resumed, 3)  # position is irrelevant, set_state overrides it
  resumed.set_state(state)
  assert_batches_equal(take(resumed, 19), reference[11:])
  assert_batches_equal(take(first, 19), reference[11:])


def test_seed_changes_train_order_not_validation(corpus):
  base = dict(batch_size=4, seq_len=8, source='text', path=str(corpus))
  a = take(make_loader(make_config(seed=0, **base), 'train'), 3)
  b = take(make_loader(make_config(seed=1, **base), 'train'), 3)
  assert any((x['inputs'] != y['inputs']).any() for x, y in zip(a, b))
  assert_batches_equal(eval_batches(make_config(seed=0, **base), 3), eval_batches(make_config(seed=1, **base), 3))


# ---------------------------------------------------------------- MQAR


def check_mqar_row(inputs, targets, mask, num_pairs):
  """Independent recomputation of the MQAR labels of one row."""
  keys = inputs[0 : 2 * num_pairs : 2].tolist()
  values = inputs[1 : 2 * num_pairs : 2].tolist()
  assert len(set(keys)) == num_pairs
  assert max(keys) < min(values) and max(values) < 256  # disjoint ranges
  pair = dict(zip(keys, values))
  assert not mask[: 2 * num_pairs].any()
  queried = []
  for t in range(2 * num_pairs, len(inputs)):
    if inputs[t] in pair and (t - 2 * num_pairs) % 2 == 0:
      assert mask[t] == 1 and targets[t] == pair[inputs[t]]
      queried.append(inputs[t])
    else:
      assert mask[t] == 0
  assert sorted(queried) == sorted(keys)  # every key queried exactly once


def test_mqar_batch_recall_targets():
  rng = np.random.default_rng(0)
  batch = mqar_batch(rng, 16, 64, num_pairs=8, vocab_size=258)
  assert batch['inputs'].shape == batch['targets'].shape == batch['mask'].shape == (16, 64)
  assert batch['inputs'].dtype == np.int32 and batch['mask'].dtype == np.float32
  assert batch['inputs'].max() < 258 and batch['inputs'].min() >= 0
  np.testing.assert_array_equal(batch['targets'][:, :-1], batch['inputs'][:, 1:])
  assert (batch['mask'].sum(1) == 8).all()
  for i in range(16):
    check_mqar_row(batch['inputs'][i], batch['targets'][i], batch['mask'][i], 8)
  # Tightest fit: seq_len = 4 * num_pairs - 1.
  tight = mqar_batch(rng, 4, 15, num_pairs=4, vocab_size=258)
  for i in range(4):
    check_mqar_row(tight['inputs'][i], tight['targets'][i], tight['mask'][i], 4)


def test_mqar_loader_streams():
  cfg = make_config(batch_size=4, seq_len=32, source='mqar', mqar_num_pairs=6)
  loader = make_loader(cfg, 'train')
  assert loader.vocab_size == 258 and loader.tokens_per_batch == 128
  train = take(loader, 2)
  val = eval_batches(cfg, 2)
  assert_batches_equal(val, eval_batches(cfg, 2))
  assert not np.array_equal(train[0]['inputs'], val[0]['inputs'])
  assert not np.array_equal(train[0]['inputs'], train[1]['inputs'])
  for b in train + val:
    for i in range(4):
      check_mqar_row(b['inputs'][i], b['targets'][i], b['mask'][i], 6)


# ---------------------------------------------------------------- errors


def _raises(match_keys, fn, *args, **kwargs):
  with pytest.raises(DataError) as err:
    fn(*args, **kwargs)
  for key in match_keys:
    assert key in str(err.value), str(err.value)
  assert isinstance(err.value, ValueError)


def test_errors(tmp_path, corpus):
  _raises(['data.source', 'mqar'], make_loader, make_config(source='tfds'), 'train')
  _raises(['data.path'], make_loader, make_config(source='text', path=''), 'train')
  _raises(['data.path', 'nope'], make_loader, make_config(source='text', path=str(tmp_path / 'nope')), 'train')
  (tmp_path / 'empty').mkdir()
  _raises(['data.path'], make_loader, make_config(source='text', path=str(tmp_path / 'empty')), 'train')
  write_files(tmp_path / 'zeros', {'a.txt': b'', 'b.txt': b''})
  _raises(['data.path'], make_loader, make_config(source='text', path=str(tmp_path / 'zeros')), 'train')
  _raises(
    ['train.batch_size', 'train.seq_len', 'sequences'],
    make_loader,
    make_config(batch_size=64, seq_len=512, source='text', path=str(corpus)),
    'train',
  )
  _raises(['train.batch_size'], make_loader, make_config(batch_size=3), 'train', process_index=0, process_count=2)
  _raises(
    ['data.mqar_num_pairs', 'train.seq_len'],
    make_loader,
    make_config(seq_len=30, source='mqar', mqar_num_pairs=8),
    'train',
  )
  _raises(['data.mqar_num_pairs'], make_loader, make_config(seq_len=4096, source='mqar', mqar_num_pairs=200), 'train')
  _raises(['data.val_fraction'], make_loader, make_config(source='text', path=str(corpus), val_fraction=0.0), 'train')


def test_random_documents_pack_rows_of_documents_in_the_range():
  from kimijax.data.documents import random_documents

  ids, positions = random_documents(6, 1000, 50, 120, seed=3)
  assert ids.shape == positions.shape == (6, 1000) and ids.dtype == positions.dtype == np.int32
  for row_ids, row_pos in zip(ids, positions):
    lengths = np.bincount(row_ids)[1:]
    assert row_ids[0] == 1 and np.all(np.diff(row_ids) >= 0) and np.all(lengths > 0)
    assert np.all((lengths[1:-1] >= 50) & (lengths[1:-1] < 120))  # the first and last are cut
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    np.testing.assert_array_equal(row_pos, np.arange(1000) - np.repeat(starts, lengths))
  again = random_documents(6, 1000, 50, 120, seed=3)
  np.testing.assert_array_equal(again[0], ids)
