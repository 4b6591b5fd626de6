"""data.source='shards': windows of the split's stream, shuffled from the seed, split across
processes, resumed exactly from the iterator state, read with bounded memory; segment ids and
positions against the shards' document index; errors name the file or key before compute."""

import collections
import json
import os
import pathlib
import subprocess
import sys

import data_helpers
import numpy as np
import pytest

from kimijax.data import DataError, data_report, eval_batches, load_tokenizer, make_loader, split_num_tokens
from kimijax.data.prepare import prepare
from kimijax.data.shards import ShardSplit, open_split, read_manifest

REPO = pathlib.Path(__file__).resolve().parents[2]


def take(loader, n):
  return [next(loader) for _ in range(n)]


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])


def rows(batches):
  """[N, T + 1] windows of a list of batches (inputs plus the last target)."""
  return np.concatenate([np.concatenate([b['inputs'], b['targets'][:, -1:]], 1) for b in batches])


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """Shards of data_helpers.small_documents() (byte tokenizer, ~10% validation) and their streams."""
  root = tmp_path_factory.mktemp('shards')
  inputs = data_helpers.write_inputs(root / 'in', data_helpers.small_documents())
  prepare([str(inputs)], root / 'out', val_fraction=0.1, workers=1, unit_mb=0.05, progress=False, log=lambda *_: None)
  m = read_manifest(root / 'out')
  streams = {s: ShardSplit(root / 'out', m['splits'][s]['shards'], m['dtype']) for s in m['splits']}
  return root / 'out', {s: st.read(0, len(st)) for s, st in streams.items()}, streams


def config(path, **kw):
  kw.setdefault('batch_size', 4)
  kw.setdefault('seq_len', 64)
  return data_helpers.make_config(source='shards', path=str(path), **kw)


def test_validation_windows_in_order_and_train_epochs_are_permutations(corpus):
  path, tokens, _ = corpus
  t = 64
  val = tokens['validation']
  n_val = (len(val) - 1) // t
  windows = np.stack([val[i * t : i * t + t + 1] for i in range(n_val)])
  got = rows(eval_batches(config(path), n_val))  # 4 rows per batch: wraps around
  np.testing.assert_array_equal(got, np.concatenate([windows] * 4)[: len(got)])
  train = tokens['train']
  n = (len(train) - 1) // t
  loader = make_loader(config(path), 'train')
  assert loader.num_sequences == n and split_num_tokens(config(path)) == len(train)
  assert loader.vocab_size == 258 and loader.eos_id == 256
  first_epoch = rows(take(loader, n // 4))
  windows = collections.Counter(train[i * t : i * t + t + 1].tobytes() for i in range(n))
  seen = collections.Counter(r.tobytes() for r in first_epoch)
  assert all(windows[w] >= k for w, k in seen.items())  # windows of the stream, none twice in the epoch
  in_order = [train[i * t : i * t + t + 1] for i in range(len(first_epoch))]
  assert not np.array_equal(first_epoch, np.stack(in_order))  # shuffled


def test_seed_changes_train_order_not_validation(corpus):
  path = corpus[0]
  a, b = take(make_loader(config(path, seed=0), 'train'), 3), take(make_loader(config(path, seed=1), 'train'), 3)
  assert any((x['inputs'] != y['inputs']).any() for x, y in zip(a, b))
  assert_batches_equal(eval_batches(config(path, seed=0), 3), eval_batches(config(path, seed=1), 3))


@pytest.mark.parametrize('document_mask', [False, True])
def test_resume_mid_epoch_is_exact(corpus, document_mask):
  path = corpus[0]
  cfg = config(path, document_mask=document_mask)
  per_epoch = make_loader(cfg, 'train').num_sequences // 4
  total = 2 * per_epoch + 5
  reference = take(make_loader(cfg, 'train'), total)
  first = make_loader(cfg, 'train')
  k = per_epoch - 3  # mid-epoch; the rest crosses two epochs
  take(first, k)
  state = json.loads(json.dumps(first.get_state()))
  resumed = make_loader(cfg, 'train')
  take(resumed, 2)
  resumed.set_state(state)
  assert_batches_equal(take(resumed, total - k), reference[k:])
  first.close()
  resumed.close()


def test_two_processes_see_the_one_process_batch(corpus):
  cfg = config(corpus[0], document_mask=True)
  one = take(make_loader(cfg, 'train'), 6)
  p0 = take(make_loader(cfg, 'train', process_index=0, process_count=2), 6)
  p1 = take(make_loader(cfg, 'train', process_index=1, process_count=2), 6)
  for full, a, b in zip(one, p0, p1):
    assert a['inputs'].shape == (2, 64)
    for k in full:
      np.testing.assert_array_equal(np.concatenate([a[k], b[k]]), full[k])


def reference_segments(start, t, eos_positions):
  """(segment_ids, positions) [t] of the inputs at stream positions [start, start + t), from the
  EOS positions of the document index."""
  seg, pos, current, opened = [], [], 1, start
  for p in range(start, start + t):
    if p > start and p in eos_positions:
      current, opened = current + 1, p
    seg.append(current)
    pos.append(p - opened)
  return seg, pos


def test_document_mask_against_the_document_index(corpus):
  path, tokens, streams = corpus
  t = 64
  eos_positions = set((streams['validation'].document_offsets()[1:] - 1).tolist())
  n_val = (len(tokens['validation']) - 1) // t
  batches = eval_batches(config(path, document_mask=True), (n_val + 3) // 4)
  plain = eval_batches(config(path), (n_val + 3) // 4)
  w = 0
  for b, p in zip(batches, plain):
    for k in p:
      np.testing.assert_array_equal(b[k], p[k])  # the same tokens and mask
    assert b['segment_ids'].dtype == b['positions'].dtype == np.int32
    for r in range(4):
      seg, pos = reference_segments((w % n_val) * t, t, eos_positions)
      assert b['segment_ids'][r].tolist() == seg and b['positions'][r].tolist() == pos
      w += 1
  assert max(b['segment_ids'].max() for b in batches) > 2  # rows with several documents


def test_document_mask_on_text_and_mqar(tmp_path):
  docs = [b'abc', b'defgh', b'i', b'jklmnopq']
  for i, d in enumerate(docs):
    (tmp_path / f'{i}.txt').write_bytes(d * 5)
  cfg = data_helpers.make_config(
    batch_size=2, seq_len=8, source='text', path=str(tmp_path), document_mask=True, val_fraction=0.5
  )
  for b in eval_batches(cfg, 2) + take(make_loader(cfg, 'train'), 3):
    for r in range(2):
      inputs = b['inputs'][r].tolist()
      seg, pos, current, opened = [], [], 1, 0
      for i, x in enumerate(inputs):  # an EOS after the first position opens a segment
        if i > 0 and x == 256:
          current, opened = current + 1, i
        seg.append(current)
        pos.append(i - opened)
      assert b['segment_ids'][r].tolist() == seg and b['positions'][r].tolist() == pos
  mqar = data_helpers.make_config(batch_size=2, seq_len=32, source='mqar', mqar_num_pairs=4, document_mask=True)
  b = next(make_loader(mqar, 'train'))
  assert (b['segment_ids'] == 1).all() and (b['positions'] == np.arange(32)).all()
  assert 'segment_ids' not in next(make_loader(data_helpers.make_config(source='mqar', mqar_num_pairs=1), 'train'))


def test_reads_are_bounded_by_one_window(tmp_path):
  tok = load_tokenizer('byte')
  root = data_helpers.write_token_corpus(tmp_path / 'c', tok, [5000, 3000, 7000, 4000])
  loader = make_loader(config(root, batch_size=2, seq_len=100), 'train')
  take(loader, 60)  # > one epoch; some windows cross shards
  s = open_split(str(root), 'train', tok)  # the loader's stream (cached per process)
  assert 0 < s.max_read_bytes <= 101 * 2  # one window, never more
  assert len(s._open) == 3


RSS_SCRIPT = r"""
import sys
import ml_collections
from kimijax.data import default_data_config, make_loader
c = ml_collections.ConfigDict({'seed': 0, 'train': {'batch_size': 16, 'seq_len': 4096}})
c.data = default_data_config()
c.data.update({'source': 'shards', 'path': sys.argv[1]})
loader = make_loader(c, 'train')
def peak_kb():   # VmHWM: this process's peak resident memory, file pages it maps included
  return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM:')).split()[1])
next(loader)
before = peak_kb()
n = 0
for _ in range(loader.num_sequences // 16 + 2):         # more than one whole epoch
  n += int(next(loader)['inputs'].size)
after = peak_kb()
loader.close()
print(n, before, after)
"""


def test_a_corpus_larger_than_the_memory_budget_trains(tmp_path):
  """One epoch over 96 MB of shards grows the reader's peak resident memory by less than 16 MB (a
  reader that mapped the shards and touched them would grow by their size: mapped file pages count
  in VmHWM)."""
  tok = load_tokenizer('byte')
  root = data_helpers.write_token_corpus(tmp_path / 'big', tok, [6 << 20] * 8 + [1 << 16], mean_doc=5000)
  corpus_bytes = sum(f.stat().st_size for f in (root / 'shards').glob('*.bin'))
  assert corpus_bytes > 96 * 2**20
  out = subprocess.run(
    [sys.executable, '-c', RSS_SCRIPT, str(root)],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'PYTHONPATH': str(REPO)},
  )
  assert out.returncode == 0, out.stderr
  n, before_kb, after_kb = map(int, out.stdout.split())
  assert n > 48 * 2**20  # every token once at least
  assert (after_kb - before_kb) * 1024 < 16 * 2**20 < corpus_bytes / 6


def test_report_lines(corpus):
  lines = data_report(config(corpus[0]))
  assert 'shards' in lines[0] and 'tokenizer byte' in lines[0]
  assert lines[1].split()[0] == 'train' and lines[2].split()[0] == 'validation'


def test_errors_name_the_file_or_key(corpus, tmp_path, bpe_json):
  path = corpus[0]

  def fails(match, cfg, split='train'):
    with pytest.raises(DataError) as err:
      make_loader(cfg, split)
    assert '\n' not in str(err.value)
    for m in match:
      assert m in str(err.value), str(err.value)

  fails(['data.path is empty'], config(''))
  fails(['does not exist'], config(tmp_path / 'nope'))
  (tmp_path / 'empty').mkdir()
  fails(['no manifest.json', 'not written by'], config(tmp_path / 'empty'))
  (tmp_path / 'unfinished').mkdir()
  (tmp_path / 'unfinished' / 'plan.json').write_text('{}')
  fails(['no manifest.json', 'resume'], config(tmp_path / 'unfinished'))
  fails(
    ["written with tokenizer 'byte'", f"data.tokenizer='hf:{bpe_json}'", "set data.tokenizer='byte'"],
    config(path, tokenizer=f'hf:{bpe_json}'),
  )
  fails(['train.batch_size=64', 'data.path', 'fewer than one global batch'], config(path, batch_size=64, seq_len=8192))
  # A truncated shard, then a corrupt one (same size), each in a copy of the corpus.
  import shutil

  for damage, message in (('truncate', 'truncated'), ('flip', 'corrupt')):
    copy = tmp_path / damage
    shutil.copytree(path, copy)
    shard = copy / read_manifest(copy)['splits']['train']['shards'][1]['file']
    data = bytearray(shard.read_bytes())
    if damage == 'truncate':
      data = data[:-2]
    else:
      data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    fails([str(shard), message], config(copy))


def test_text_sources_take_data_tokenizer(tmp_path, bpe_json):
  """data.tokenizer applies to the in-memory corpora too: the stream is each file's ids, then EOS."""
  docs = data_helpers.small_documents()[:60]
  for i, d in enumerate(docs):
    (tmp_path / f'{i:03d}.txt').write_text(d, encoding='utf-8')
  spec = f'hf:{bpe_json}'
  cfg = data_helpers.make_config(batch_size=2, seq_len=32, source='text', path=str(tmp_path), tokenizer=spec)
  from kimijax.data.sources import split_files

  tok = load_tokenizer(spec)
  files = split_files(sorted(tmp_path.glob('*.txt')), tmp_path, 'validation', 0.05)
  expected = np.concatenate([x for f in files for x in (tok.encode(f.read_text()), [tok.eos_id])])
  n = (len(expected) - 1) // 32
  got = rows(eval_batches(cfg, n // 2))
  np.testing.assert_array_equal(got, np.stack([expected[i * 32 : i * 32 + 33] for i in range(len(got))]))
  loader = make_loader(cfg, 'train')
  assert loader.vocab_size == 1000 and loader.eos_id == tok.eos_id
  assert split_num_tokens(cfg, 'validation') == len(expected)
  assert any('tokenizer' in line and spec in line for line in data_report(cfg))
