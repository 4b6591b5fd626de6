"""python -m kimijax.data.prepare: the shards hold exactly the tokens of tokenizing the documents in
memory, the split follows each document's content whatever the file order, a killed run resumes to
the same bytes, a finished run is left alone, and bad input stops with one line naming the file."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import data_helpers
import numpy as np
import pytest

from kimijax.data import DataError, load_tokenizer
from kimijax.data.prepare import prepare
from kimijax.data.shards import ShardSplit, read_manifest, verify_split

REPO = pathlib.Path(__file__).resolve().parents[2]
VAL = 0.2


def run(inputs, output, **kw):
  kw.setdefault('val_fraction', VAL)
  kw.setdefault('workers', 1)
  kw.setdefault('unit_mb', 0.02)
  return prepare([str(i) for i in inputs], output, progress=False, log=lambda *_: None, **kw)


def stream(output, split):
  m = read_manifest(output)
  return ShardSplit(pathlib.Path(output), m['splits'][split]['shards'], m['dtype'])


def reference_stream(docs, tokenizer, split):
  """Each document of `split` tokenized alone, followed by EOS, in input order."""
  parts = []
  for d in docs:
    if d and data_helpers.doc_split(d, VAL) == split:
      parts += [tokenizer.encode(d), [tokenizer.eos_id]]
  return np.concatenate(parts).astype(np.int32)


def shard_bytes(output):
  return {p.name: p.read_bytes() for p in sorted((pathlib.Path(output) / 'shards').iterdir())}


@pytest.fixture(scope='module')
def docs():
  return data_helpers.documents()


@pytest.mark.parametrize('kind', ['byte', 'hf', 'tiktoken'])
def test_shards_hold_the_in_memory_tokens(kind, docs, tmp_path, bpe_json, tiktoken_path):
  spec = {'byte': 'byte', 'hf': f'hf:{bpe_json}', 'tiktoken': f'tiktoken:{tiktoken_path}'}[kind]
  inputs = data_helpers.write_inputs(tmp_path / 'in', docs)
  result = run([inputs], tmp_path / 'out', tokenizer=spec)
  m = result['manifest']
  tok = load_tokenizer(spec)
  ordered = data_helpers.input_order(docs)
  for split in ('train', 'validation'):
    expected = reference_stream(ordered, tok, split)
    got = stream(tmp_path / 'out', split)
    assert len(got) == len(expected) == m['splits'][split]['tokens']
    np.testing.assert_array_equal(got.read(0, len(got)), expected)
    n_docs = sum(1 for d in ordered if data_helpers.doc_split(d, VAL) == split)
    assert m['splits'][split]['docs'] == n_docs > 0
    # The index: document d is its tokens and its EOS.
    offsets = got.document_offsets()
    assert len(offsets) == n_docs + 1 and offsets[-1] == len(got)
    assert (expected[offsets[1:] - 1] == tok.eos_id).all()
    verify_split(str(tmp_path / 'out'), split)
  assert m['dtype'] == 'uint16' and m['tokenizer']['fingerprint'] == tok.fingerprint
  assert len(m['splits']['train']['shards']) > 3  # several units
  assert m['text_bytes'] == sum(len(d.encode()) for d in docs)
  assert [pathlib.Path(s['path']).name for s in m['sources']] == sorted(
    p.name for p in inputs.rglob('*') if p.is_file() and p.name not in ('image.bin', '.hidden.txt')
  )
  assert [pathlib.Path(p).name for p in m['skipped_files']] == ['image.bin']


def test_split_and_tokens_do_not_depend_on_file_order_or_names(docs, tmp_path):
  a = data_helpers.write_inputs(tmp_path / 'a', docs)
  shuffled = [docs[i] for i in np.random.default_rng(1).permutation(len(docs))]
  b = data_helpers.write_inputs(tmp_path / 'b', shuffled)  # other files, other order
  run([a], tmp_path / 'out_a')
  run([b / 'txt', b / 'd.parquet', b / '*.jsonl*'], tmp_path / 'out_b')  # other --input order too
  for split in ('train', 'validation'):
    got = {}
    for name in ('a', 'b'):
      s = stream(tmp_path / f'out_{name}', split)
      tokens, offsets = s.read(0, len(s)), s.document_offsets()
      got[name] = sorted(bytes(tokens[i:j].astype(np.uint16)) for i, j in zip(offsets[:-1], offsets[1:]))
    assert got['a'] == got['b']
    assert len(got['a']) == sum(1 for d in docs if data_helpers.doc_split(d, VAL) == split)
  # The same inputs named in another order give the same shards, byte for byte.
  run([a / 'txt', a / '*.parquet', a / 'c.jsonl.zst', a / 'b.jsonl.gz', a / 'a.jsonl'], tmp_path / 'out_a2')
  assert shard_bytes(tmp_path / 'out_a') == shard_bytes(tmp_path / 'out_a2')


def test_finished_output_is_left_alone_and_other_inputs_refused(docs, tmp_path):
  inputs = data_helpers.write_inputs(tmp_path / 'in', docs)
  run([inputs], tmp_path / 'out')
  stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / 'out').rglob('*')}
  again = run([inputs], tmp_path / 'out')
  assert again['already_done']
  assert stamp == {p: p.stat().st_mtime_ns for p in (tmp_path / 'out').rglob('*')}
  with pytest.raises(DataError, match='other inputs or options'):
    run([inputs], tmp_path / 'out', val_fraction=0.3)
  (inputs / 'a.jsonl').write_text((inputs / 'a.jsonl').read_text() + '{"text": "one more"}\n')
  with pytest.raises(DataError, match='other inputs or options'):
    run([inputs], tmp_path / 'out')


def test_resume_after_sigkill_is_exact(docs, tmp_path, bpe_json):
  inputs = data_helpers.write_inputs(tmp_path / 'in', docs * 3)
  args = [
    sys.executable,
    '-m',
    'kimijax.data.prepare',
    f'--input={inputs}',
    f'--tokenizer=hf:{bpe_json}',
    f'--val_fraction={VAL}',
    '--unit_mb=0.005',
    '--workers=1',
    '--no_progress',
  ]
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  killed = subprocess.Popen(
    args + [f'--output={tmp_path / "killed"}'], cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  units = tmp_path / 'killed' / 'units'
  deadline = time.time() + 60
  while time.time() < deadline and len(list(units.glob('*.json'))) < 3:
    time.sleep(0.01)
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  committed = len(list(units.glob('*.json')))
  assert committed >= 3 and not (tmp_path / 'killed' / 'manifest.json').exists()
  resumed = subprocess.run(
    args + [f'--output={tmp_path / "killed"}'], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
  )
  assert resumed.returncode == 0, resumed.stderr
  assert f'resuming: {committed} of' in resumed.stdout
  fresh = run([inputs], tmp_path / 'fresh', tokenizer=f'hf:{bpe_json}', unit_mb=0.005)
  assert shard_bytes(tmp_path / 'killed') == shard_bytes(tmp_path / 'fresh')
  assert read_manifest(tmp_path / 'killed')['splits'] == fresh['manifest']['splits']


def test_two_workers_write_what_one_writes(docs, tmp_path):
  inputs = data_helpers.write_inputs(tmp_path / 'in', docs)
  run([inputs], tmp_path / 'one')
  run([inputs], tmp_path / 'two', workers=2)
  assert shard_bytes(tmp_path / 'one') == shard_bytes(tmp_path / 'two')


def test_trained_tokenizer_is_deterministic_and_reused(docs, tmp_path):
  inputs = data_helpers.write_inputs(tmp_path / 'in', docs)
  a = run([inputs], tmp_path / 'a', train_tokenizer=600)
  b = run([inputs], tmp_path / 'b', train_tokenizer=600)
  assert (tmp_path / 'a' / 'tokenizer.json').read_bytes() == (tmp_path / 'b' / 'tokenizer.json').read_bytes()
  assert shard_bytes(tmp_path / 'a') == shard_bytes(tmp_path / 'b')
  tok = load_tokenizer(f'hf:{tmp_path / "a" / "tokenizer.json"}')
  assert a['manifest']['tokenizer']['fingerprint'] == tok.fingerprint and tok.vocab_size <= 600
  assert a['manifest']['tokenizer']['file_in_dir'] == 'tokenizer.json'
  for d in docs[:10]:
    assert tok.decode(tok.encode(d)) == d
  assert b['manifest']['splits'] == a['manifest']['splits']


def test_bad_input_is_one_line_before_any_tokenization(tmp_path):
  def fails(match, inputs, **kw):
    with pytest.raises(DataError) as err:
      run(inputs, tmp_path / f'out{len(list(tmp_path.iterdir()))}', **kw)
    assert '\n' not in str(err.value)
    for m in match:
      assert m in str(err.value), str(err.value)

  fails(['does not exist'], [tmp_path / 'nope'])
  fails(['matches no file'], [tmp_path / '*.jsonl'])
  (tmp_path / 'empty').mkdir()
  (tmp_path / 'empty' / 'a.txt').write_text('')
  fails(['no documents'], [tmp_path / 'empty'])
  (tmp_path / 'j').mkdir()
  (tmp_path / 'j' / 'a.jsonl').write_text('{"content": "x"}\n')
  fails([str(tmp_path / 'j' / 'a.jsonl'), "no field 'text'", "['content']", '--text_field'], [tmp_path / 'j'])
  (tmp_path / 'j' / 'a.jsonl').write_text('{"text": "fine"}\n{"body": "x"}\n')
  fails([str(tmp_path / 'j' / 'a.jsonl'), 'line 2', "no field 'text'"], [tmp_path / 'j'])
  (tmp_path / 'j' / 'a.jsonl').write_text('{"text": 3}\n')
  fails(["field 'text' is a int"], [tmp_path / 'j'])
  (tmp_path / 'j' / 'a.jsonl').write_text('{"text": ""}\n{"text": null}\n')
  fails(['no non-empty documents'], [tmp_path / 'j'])
  import pyarrow as pa
  import pyarrow.parquet as pq

  (tmp_path / 'p').mkdir()
  pq.write_table(pa.table({'content': ['a', 'b']}), tmp_path / 'p' / 'x.parquet')
  fails([str(tmp_path / 'p' / 'x.parquet'), "no column 'text'", "['content']"], [tmp_path / 'p'])
  (tmp_path / 'p' / 'x.parquet').write_bytes(b'PAR1 not really')
  fails([str(tmp_path / 'p' / 'x.parquet'), 'not a parquet file'], [tmp_path / 'p'])
  (tmp_path / 'ok.txt').write_text('text')
  (tmp_path / 'bad.json').write_text('{')
  fails([str(tmp_path / 'bad.json')], [tmp_path / 'ok.txt'], tokenizer=f'hf:{tmp_path / "bad.json"}')
  (tmp_path / 'full').mkdir()
  (tmp_path / 'full' / 'x').write_text('x')
  with pytest.raises(DataError, match='not empty'):
    run([tmp_path / 'ok.txt'], tmp_path / 'full')
  # option errors leave --output unwritten, so the corrected command runs there
  for kw, message in [
    ({'train_tokenizer': 10}, '--train_tokenizer=10 is below 258'),
    ({'workers': -1}, '--workers=-1 must be >= 0'),
    ({'unit_mb': 0}, '--unit_mb=0 must be positive'),
  ]:
    with pytest.raises(DataError, match=message):
      run([tmp_path / 'ok.txt'], tmp_path / 'fresh', **kw)
    assert not (tmp_path / 'fresh').exists()
  with pytest.raises(DataError, match=f'{tmp_path / "ok.txt"} is a file, not a folder'):
    run([tmp_path / 'ok.txt'], tmp_path / 'ok.txt' / 'out')


def test_a_failed_preparation_leaves_no_trace_and_the_corrected_command_runs_there(tmp_path):
  """Input that fails (not text; a .gz cut short, which fails only once it is read; options that
  leave the train split empty) stops with one line naming it and removes what it wrote: no
  .lock or plan.json left in --output, the folders it created gone, a folder that was there kept
  (empty). The corrected command then prepares on the same --output."""
  import gzip

  (tmp_path / 'bin.dat').write_bytes(bytes(range(256)) * 8)
  lines = b''.join(json.dumps({'text': f'document {i} ' * 20}).encode() + b'\n' for i in range(500))
  packed = gzip.compress(lines)
  (tmp_path / 'cut.jsonl.gz').write_bytes(packed[: len(packed) // 2])
  (tmp_path / 'ok.txt').write_text('some text to tokenize\n')
  (tmp_path / 'there').mkdir()
  cases = [
    ([tmp_path / 'bin.dat'], {}, tmp_path / 'new1' / 'out', 'holds no documents'),
    (
      [tmp_path / 'cut.jsonl.gz'],
      {},
      tmp_path / 'new2' / 'out',
      f'{tmp_path / "cut.jsonl.gz"} cannot be read (EOFError',
    ),
    ([tmp_path / 'ok.txt'], {'val_fraction': 0.999}, tmp_path / 'there', 'no non-empty documents for the train split'),
  ]
  for inputs, kw, output, message in cases:
    with pytest.raises(DataError) as err:
      run(inputs, output, **kw)
    assert message in str(err.value) and '\n' not in str(err.value), str(err.value)
    if output.name == 'there':
      assert list(output.iterdir()) == []
    else:
      assert not output.parent.exists()
    done = run([tmp_path / 'ok.txt'], output)
    assert not done['already_done'] and done['manifest']['splits']['train']['tokens'] > 0


def test_command_line(tmp_path):
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'a.jsonl').write_text('{"body": "x"}\n')
  cmd = [sys.executable, '-m', 'kimijax.data.prepare', f'--input={tmp_path / "in"}', f'--output={tmp_path / "o"}']
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  bad = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and bad.stderr.count('\n') == 1 and "no field 'text'" in bad.stderr
  good = subprocess.run(
    cmd + ['--text_field=body', '--no_progress'], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
  )
  assert good.returncode == 0, good.stderr
  assert json.loads((tmp_path / 'o' / 'manifest.json').read_text())['text_field'] == 'body'
