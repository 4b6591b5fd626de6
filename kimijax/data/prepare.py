"""Text corpora -> token shards for data.source='shards' (format: kimijax/data/shards.py).

    python -m kimijax.data.prepare --input='~/fineweb/sample-10BT/*.parquet' \
        --tokenizer=tiktoken:~/kimi/tiktoken.model --output=data/fineweb10b
    python -m kimijax.data.prepare --input=~/corpus --input=~/more.jsonl.zst --train_tokenizer=32768 \
        --output=data/mycorpus
    then train with data.source='shards', data.path=DIR and data.tokenizer set to the same tokenizer
    (with --train_tokenizer: 'hf:DIR/tokenizer.json').

Inputs (kimijax/data/inputs.py): files, folders and globs of .txt (and any UTF-8 text file: one
document each), .jsonl / .ndjson (+ .gz, .zst; one document per line, field --text_field) and
.parquet (FineWeb's layout: column --text_field). Every file is checked (a JSONL file's first record,
a parquet file's schema) before any tokenization.

Steps: (1) with --train_tokenizer=V, a byte-level BPE of V ids (kimijax/data/bpe_train.py) is trained
on the first --tokenizer_sample_mb MB of training documents, taken from the units in a fixed
pseudo-random order, and saved as DIR/tokenizer.json: same inputs, same tokenizer. (2) The inputs, in
units of about --unit_mb MB, are tokenized by --workers processes (default: every core; one thread
each), with progress and ETA. Each document goes to validation iff the first 8 bytes of the SHA-256
of its UTF-8 text, read as a fraction of 2^64, fall below --val_fraction: a document's split depends
on its content only, never on file order or paths, and copies of one document share it. Empty
documents are skipped. (3) manifest.json is written last.

Resuming: each finished unit is committed by DIR/units/unit-N.json (its shards are written
atomically before it). A run that is killed (even SIGKILL) resumes from the committed units when the
same command is run again; the result is the same as an uninterrupted run. Run on a finished DIR with
the same inputs and options, it says so and does nothing; on a DIR holding other inputs or options it
stops with an error. DIR/plan.json records the inputs (path, size, mtime) and options. A fresh
preparation that stops on its input or options (a DataError: no documents, a file that cannot be
read, an empty train split) removes what it wrote, its .lock and the folders it created, so that
the corrected command runs on the same --output.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import multiprocessing
import os
import pathlib
import sys
import time

import numpy as np

from kimijax.data import inputs as inputs_lib, shards as shards_lib
from kimijax.data.sources import SPLITS, DataError
from kimijax.data.tokenizer import file_sha256, load_tokenizer

BATCH_DOCS = 256  # documents per encode_batch call
BATCH_BYTES = 8 << 20


def document_split(data: bytes, val_fraction: float) -> str:
  """'validation' iff SHA-256(data)[:8] / 2**64 < val_fraction, else 'train'."""
  unit = int.from_bytes(hashlib.sha256(data).digest()[:8], 'big') / 2**64
  return 'validation' if unit < val_fraction else 'train'


def _write_json(path: pathlib.Path, data) -> None:
  tmp = path.with_name(f'{path.name}.{os.getpid()}.tmp')
  tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + '\n')
  os.replace(tmp, path)


# ------------------------------------------------------------------ one unit (in a worker)


def tokenize_unit(unit: int, pieces, *, tokenizer, output: pathlib.Path, text_field: str, val_fraction: float) -> dict:
  """Tokenizes the documents of `pieces` into the unit's shards (one per split that gets
  documents), then commits the unit by writing DIR/units/unit-N.json; returns that record. Memory
  is bounded by one batch of documents, whatever the unit's size."""
  writers = {s: shards_lib.ShardWriter(output, f'{s}-{unit:06d}', tokenizer.token_dtype) for s in SPLITS}
  stats = {'text_bytes': 0, 'skipped_documents': 0}
  eos = np.array([tokenizer.eos_id], dtype=np.int32)

  def flush(batch):
    data = [d if isinstance(d, bytes) else d.encode('utf-8') for d in batch]
    keep = [i for i, d in enumerate(data) if d]
    stats['skipped_documents'] += len(batch) - len(keep)
    out = {s: [] for s in SPLITS}
    for i, ids in zip(keep, tokenizer.encode_batch([batch[i] for i in keep])):
      out[document_split(data[i], val_fraction)].append(np.concatenate([ids, eos]))
      stats['text_bytes'] += len(data[i])
    for split, docs in out.items():
      writers[split].append(docs)

  hashes = {}
  try:
    for piece in pieces:
      if piece.start == 0:
        hashes[piece.path] = file_sha256(piece.path)
      batch, size = [], 0
      for doc in inputs_lib.read_documents(piece, text_field):
        batch.append(doc)
        size += len(doc)
        if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
          flush(batch)
          batch, size = [], 0
      flush(batch)
  except BaseException:
    for w in writers.values():
      w.discard()
    raise
  record = {'unit': unit, 'input_bytes': sum(p.nbytes for p in pieces), 'file_sha256': hashes, 'shards': {}, **stats}
  for split, writer in writers.items():
    if writer.docs:
      record['shards'][split] = writer.close()
    else:
      writer.discard()
  _write_json(output / 'units' / f'unit-{unit:06d}.json', record)
  return record


_WORKER = {}


def _init_worker(spec: str, kwargs: dict) -> None:
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _WORKER.update(tokenizer=load_tokenizer(spec), **kwargs)


def _run_unit(task):
  unit, pieces = task
  return tokenize_unit(unit, pieces, **_WORKER)


# ------------------------------------------------------------------ planning


def _plan(files, options: dict) -> dict:
  return {
    'format': shards_lib.FORMAT,
    'options': options,
    'files': [{'path': str(f), 'size': f.stat().st_size, 'mtime_ns': f.stat().st_mtime_ns} for f in files],
  }


def _units(plan: dict, text_field: str, unit_bytes: int):
  """(units: [[Piece]], used files, skipped files): checks every file before any compute."""
  pieces, used, skipped = [], [], []
  for entry in plan['files']:
    path, size = pathlib.Path(entry['path']), entry['size']
    if size == 0:
      continue
    kind = inputs_lib.input_kind(path)
    if not inputs_lib.check_file(path, kind, text_field):
      skipped.append(str(path))
      continue
    used.append({'path': str(path), 'size': size, 'kind': kind})
    pieces += inputs_lib.file_pieces(path, kind, size, unit_bytes)
  if not pieces:
    raise DataError(
      f'--input={plan["options"]["inputs"]} holds no documents: {len(plan["files"])} file(s), '
      f'all empty{" or not text" if skipped else ""}'
    )
  return inputs_lib.group_units(pieces, unit_bytes), used, skipped


def _sample_texts(units, text_field: str, val_fraction: float, sample_bytes: int):
  """Training documents (str) from the units in a fixed pseudo-random order, up to sample_bytes."""
  order = np.random.default_rng(0).permutation(len(units))
  taken = 0
  for u in order:
    for piece in units[u]:
      for doc in inputs_lib.read_documents(piece, text_field):
        data = doc if isinstance(doc, bytes) else doc.encode('utf-8')
        if not data or document_split(data, val_fraction) != 'train':
          continue
        yield doc if isinstance(doc, str) else doc.decode('utf-8', errors='replace')
        taken += len(data)
        if taken >= sample_bytes:
          return


def _train_tokenizer(output: pathlib.Path, units, options: dict, log) -> str:
  from kimijax.data import bpe_train

  path = output / 'tokenizer.json'
  if not path.is_file():
    log(
      f'training a byte-level BPE of {options["train_tokenizer"]:,} ids on up to '
      f'{options["tokenizer_sample_bytes"] / 2**20:,.0f} MB of training documents'
    )
    began = time.time()
    previous = os.environ.get('TOKENIZERS_PARALLELISM')
    os.environ['TOKENIZERS_PARALLELISM'] = 'true'  # the trainer may use every core
    try:
      tok = bpe_train.train_bpe(
        _sample_texts(units, options['text_field'], options['val_fraction'], options['tokenizer_sample_bytes']),
        options['train_tokenizer'],
      )
    finally:
      if previous is None:
        os.environ.pop('TOKENIZERS_PARALLELISM', None)
      else:
        os.environ['TOKENIZERS_PARALLELISM'] = previous
    bpe_train.save_bpe(tok, output)
    log(f'trained in {time.time() - began:.1f} s: {path}')
  return f'hf:{path}'


def _manifest(plan, records, tokenizer, used, skipped, spec_file) -> dict:
  hashes = {p: h for r in records for p, h in r['file_sha256'].items()}
  splits = {}
  for split in SPLITS:
    shards = [r['shards'][split] for r in records if split in r['shards']]
    splits[split] = {
      'docs': sum(s['docs'] for s in shards),
      'tokens': sum(s['tokens'] for s in shards),
      'shards': shards,
    }
  described = tokenizer.describe()
  if spec_file:
    described['file_in_dir'] = spec_file
  o = plan['options']
  return {
    'format': shards_lib.FORMAT,
    'version': shards_lib.VERSION,
    'dtype': tokenizer.token_dtype.name,
    'tokenizer': described,
    'val_fraction': o['val_fraction'],
    'text_field': o['text_field'],
    'split_rule': 'validation iff int(sha256(utf-8 text)[:8], big-endian) / 2**64 < val_fraction',
    'sources': [{**u, 'sha256': hashes[u['path']]} for u in used],
    'skipped_files': skipped,
    'text_bytes': sum(r['text_bytes'] for r in records),
    'documents_skipped': sum(r['skipped_documents'] for r in records),
    'splits': splits,
    'plan': plan,
  }


def _describe(manifest: dict) -> str:
  s = manifest['splits']
  return (
    f'{s["train"]["docs"]:,} train documents ({s["train"]["tokens"]:,} tokens), '
    f'{s["validation"]["docs"]:,} validation ({s["validation"]["tokens"]:,} tokens), '
    f'{manifest["text_bytes"] / 2**20:,.1f} MB of text, tokenizer {manifest["tokenizer"]["spec"]}'
  )


# ------------------------------------------------------------------ the command


def prepare(
  inputs,
  output,
  *,
  tokenizer: str = 'byte',
  train_tokenizer: int = 0,
  tokenizer_sample_mb: float = 256.0,
  text_field: str = 'text',
  val_fraction: float = 0.01,
  workers: int | None = None,
  unit_mb: float = 32.0,
  progress: bool = True,
  log=print,
) -> dict:
  """Prepares (or resumes, or finds finished) the shards of `inputs` in `output`; returns
  {'already_done': bool, 'manifest': dict, 'output': str, 'seconds': float}. See the module
  docstring; DataError on bad input, before any tokenization where the checks can tell (a file
  damaged past its first record fails once it is read); a fresh preparation's DataError leaves
  `output` as it found it."""
  began = time.time()
  if not 0.0 <= val_fraction < 1.0:
    raise DataError(f'--val_fraction={val_fraction} must be in [0, 1)')
  if train_tokenizer and tokenizer != 'byte':
    raise DataError('give either --tokenizer or --train_tokenizer, not both')
  if train_tokenizer:
    from kimijax.data.bpe_train import check_vocab_size

    check_vocab_size(train_tokenizer)  # before anything is written to --output
  if workers is not None and workers < 0:
    raise DataError(f'--workers={workers} must be >= 0 (0: one per core)')
  if not unit_mb > 0:
    raise DataError(f'--unit_mb={unit_mb} must be positive')
  workers = max(1, int(workers or os.cpu_count() or 1))
  unit_bytes = max(1, int(unit_mb * 2**20))
  output = pathlib.Path(output).expanduser()
  existing = next((p for p in (output, *output.absolute().parents) if p.exists()), None)
  if existing is not None and not existing.is_dir():
    raise DataError(f'--output={output}: {existing} is a file, not a folder')
  files = inputs_lib.expand_inputs(inputs)
  if not train_tokenizer:
    tok = load_tokenizer(tokenizer)
  options = {
    'inputs': [str(i) for i in inputs],
    'text_field': text_field,
    'val_fraction': val_fraction,
    'unit_bytes': unit_bytes,
    'tokenizer': None if train_tokenizer else tokenizer,
    'tokenizer_fingerprint': None if train_tokenizer else tok.fingerprint,
    'train_tokenizer': int(train_tokenizer),
    'tokenizer_sample_bytes': int(tokenizer_sample_mb * 2**20),
  }
  plan = _plan(files, options)
  comparable = lambda p: {**p, 'options': {k: v for k, v in p['options'].items() if k not in ('inputs', 'tokenizer')}}

  created = [p for p in (output, *output.parents) if not p.exists()]  # innermost first
  output.mkdir(parents=True, exist_ok=True)
  lock = open(output / '.lock', 'a')
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    lock.close()
    raise DataError(f'--output={output} is being written by another kimijax.data.prepare') from None
  fresh = False  # set once this call starts a preparation in an empty --output
  try:
    if (output / 'manifest.json').is_file():
      manifest = shards_lib.read_manifest(output)
      if comparable(manifest['plan']) != comparable(plan):
        raise DataError(
          f'--output={output} already holds shards of other inputs or options; choose another --output or delete it'
        )
      log(f'{output}: already prepared, nothing to do: {_describe(manifest)}')
      return {'already_done': True, 'manifest': manifest, 'output': str(output), 'seconds': time.time() - began}
    if (output / 'plan.json').is_file():
      if comparable(json.loads((output / 'plan.json').read_text())) != comparable(plan):
        raise DataError(
          f'--output={output} holds an unfinished preparation of other inputs or options '
          f'({output / "plan.json"}); choose another --output or delete it'
        )
      resuming = True
    else:
      if any(p.name != '.lock' for p in output.iterdir()):
        raise DataError(
          f'--output={output} is not empty and holds no kimijax.data.prepare plan; choose an empty or new folder'
        )
      resuming, fresh = False, True
    units, used, skipped = _units(plan, text_field, unit_bytes)
    _write_json(output / 'plan.json', plan)
    (output / 'units').mkdir(exist_ok=True)
    for stale in list(output.glob('*.tmp')) + list(output.glob('*/*.tmp')):
      stale.unlink(missing_ok=True)
    if skipped:
      log(f'skipping {len(skipped)} file(s) that are not text, e.g. {skipped[0]}')

    spec_file = None
    if train_tokenizer:
      tokenizer = _train_tokenizer(output, units, options, log)
      tok, spec_file = load_tokenizer(tokenizer), 'tokenizer.json'

    records = _tokenize_units(output, units, tokenizer, tok, text_field, val_fraction, workers, resuming, progress, log)
    manifest = _manifest(plan, records, tok, used, skipped, spec_file)
    if manifest['splits']['train']['tokens'] == 0:
      raise DataError(f'--input={list(inputs)} holds no non-empty documents for the train split')
    _write_json(output / 'manifest.json', manifest)
    log(f'{output}: {_describe(manifest)}; {time.time() - began:.1f} s')
    return {'already_done': False, 'manifest': manifest, 'output': str(output), 'seconds': time.time() - began}
  except DataError:
    if fresh:  # bad input: nothing of this preparation can be resumed by the corrected command
      _remove_preparation(output, created)
    raise
  finally:
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()


def _remove_preparation(output: pathlib.Path, created: list[pathlib.Path]) -> None:
  """Removes what a fresh preparation wrote in `output` (which held nothing else: at most a .lock)
  and the folders in `created` (innermost first) that are then empty, so that the corrected command
  finds --output as it was. Called under the lock: the .lock goes last."""
  import shutil

  for entry in output.iterdir():
    if entry.name == '.lock':
      continue
    if entry.is_dir() and not entry.is_symlink():
      shutil.rmtree(entry, ignore_errors=True)
    else:
      entry.unlink(missing_ok=True)
  (output / '.lock').unlink(missing_ok=True)
  for folder in created:
    try:
      folder.rmdir()
    except OSError:  # not empty (another process's .lock since), or gone
      break


def _tokenize_units(output, units, spec, tok, text_field, val_fraction, workers, resuming, progress, log):
  """Runs the units that have no committed record; returns every unit's record in unit order."""
  import tqdm

  os.environ['TOKENIZERS_PARALLELISM'] = 'false'  # one thread per worker process
  done = {}
  for u in range(len(units)):
    path = output / 'units' / f'unit-{u:06d}.json'
    if path.is_file():
      done[u] = json.loads(path.read_text())
  todo = [(u, units[u]) for u in range(len(units)) if u not in done]
  total = sum(p.nbytes for unit in units for p in unit)
  if resuming:
    log(f'resuming: {len(done)} of {len(units)} units already done')
  bar = tqdm.tqdm(
    total=total,
    initial=sum(r['input_bytes'] for r in done.values()),
    unit='B',
    unit_scale=True,
    desc='prepare',
    disable=not progress,
    mininterval=1.0,
    dynamic_ncols=True,
  )
  kwargs = {'output': output, 'text_field': text_field, 'val_fraction': val_fraction}
  text_bytes, started = 0, time.time()

  def finished(record):
    nonlocal text_bytes
    done[record['unit']] = record
    text_bytes += record['text_bytes']
    bar.update(record['input_bytes'])
    bar.set_postfix(text=f'{text_bytes / 2**20 / max(time.time() - started, 1e-9):.2f} MB/s', refresh=False)

  try:
    if workers == 1 or len(todo) <= 1:
      for u, pieces in todo:
        finished(tokenize_unit(u, pieces, tokenizer=tok, **kwargs))
    else:
      ctx = multiprocessing.get_context('spawn')
      with ctx.Pool(min(workers, len(todo)), initializer=_init_worker, initargs=(spec, kwargs)) as pool:
        for record in pool.imap_unordered(_run_unit, todo):
          finished(record)
  finally:
    bar.close()
  return [done[u] for u in range(len(units))]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m kimijax.data.prepare', description=__doc__.split('\n')[0])
  parser.add_argument(
    '--input',
    action='append',
    required=True,
    help='a file, folder or glob of .txt/.jsonl[.gz|.zst]/.parquet (repeatable)',
  )
  parser.add_argument('--output', required=True, help='the folder of the shards (data.path)')
  parser.add_argument('--tokenizer', default='byte', help="'byte', 'hf:PATH' or 'tiktoken:PATH[#PRESET]'")
  parser.add_argument(
    '--train_tokenizer', type=int, default=0, help='train a byte-level BPE of this many ids first (DIR/tokenizer.json)'
  )
  parser.add_argument(
    '--tokenizer_sample_mb', type=float, default=256.0, help='MB of training documents the BPE is trained on'
  )
  parser.add_argument('--text_field', default='text', help='the JSONL field / parquet column of the text')
  parser.add_argument('--val_fraction', type=float, default=0.01, help='fraction of documents for validation')
  parser.add_argument('--workers', type=int, default=0, help='tokenizing processes (0: one per core)')
  parser.add_argument('--unit_mb', type=float, default=32.0, help='MB of input per unit of work (and per shard)')
  parser.add_argument('--no_progress', action='store_true', help='no progress bar')
  args = parser.parse_args(argv)
  try:
    prepare(
      args.input,
      args.output,
      tokenizer=args.tokenizer,
      train_tokenizer=args.train_tokenizer,
      tokenizer_sample_mb=args.tokenizer_sample_mb,
      text_field=args.text_field,
      val_fraction=args.val_fraction,
      workers=args.workers,
      unit_mb=args.unit_mb,
      progress=not args.no_progress,
    )
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
