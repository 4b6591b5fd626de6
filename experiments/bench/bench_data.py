"""Data throughput: `kimijax.data.prepare` in MB of text per second, and the shard loader in tokens
per second per process at the training shapes.

    python -m experiments.bench.bench_data [--corpus=site_packages] [--corpus_mb=48] [--vocab=32768] [--workers=1,2]

The corpus: the first --corpus_mb MB of .py files, one document per file: --corpus=stdlib, the files of
data.source='stdlib' (both splits, sorted by path); --corpus=site_packages, the files under the
interpreter's site-packages (kimijax/data/site_packages.py's roots, copies included, sorted by path).
Prepare is timed end to end (listing, checks, worker start-up, tokenizing, writing, manifest), in
wall time and in CPU time of all its processes, with each tokenizer: 'byte'; 'hf',
a byte-level BPE of --vocab ids trained (and timed) first on --sample_mb MB of the corpus; 'tiktoken',
the same BPE's vocabulary written as a tiktoken file (the 'default' preset's regex, so its ids differ
a little from the BPE's own). MB/s = text bytes / wall seconds. The loader reads the 'hf' shards
(uint16), through make_loader (grain, one prefetch thread) as training does, after 3 warm-up batches;
shapes: the ladders' (configs/ladder.py: smoke 8 and 16 x 128; gpu 16, 32, 64, 128 x 1024) and
bench_350m's 16 x 4096, with data.document_mask off and on. Prints Markdown table rows.
(2-core shared CPU: experiments/results/bench_data.md.)
"""

import base64
import json
import os
import pathlib
import shutil
import tempfile
import time

from absl import app, flags

flags.DEFINE_enum('corpus', 'site_packages', ['stdlib', 'site_packages'], 'whose .py files to prepare')
flags.DEFINE_float('corpus_mb', 48.0, 'MB of source to prepare')
flags.DEFINE_integer('vocab', 32768, 'ids of the trained BPE')
flags.DEFINE_float('sample_mb', 8.0, 'MB of text the BPE is trained on')
flags.DEFINE_string('workers', '1,2', 'worker process counts for prepare')
flags.DEFINE_string('tokenizers', 'byte,hf,tiktoken', 'tokenizers for prepare')
flags.DEFINE_integer('batches', 200, 'timed loader batches per shape (fewer for the larger shapes)')
flags.DEFINE_string('keep', '', 'keep the prepared shards in this folder (default: a temporary one)')
FLAGS = flags.FLAGS

LOADER_SHAPES = (
  ('ladder smoke d32/d48', 8, 128),
  ('ladder smoke d64', 16, 128),
  ('ladder gpu d128', 16, 1024),
  ('ladder gpu d192', 32, 1024),
  ('ladder gpu d256/d320', 64, 1024),
  ('ladder gpu d384', 128, 1024),
  ('bench_350m', 16, 4096),
)


def corpus_files(corpus: str, mb: float) -> list[pathlib.Path]:
  if corpus == 'stdlib':
    from kimijax.data.sources import stdlib_files

    candidates = stdlib_files()
  else:
    from kimijax.data import site_packages

    candidates = sorted(
      {p.resolve() for root in site_packages.site_packages_roots() for p in site_packages._python_files(root)}, key=str
    )
  files, total = [], 0
  for f in candidates:
    if total >= mb * 2**20:
      break
    size = f.stat().st_size
    if size:
      files.append(f)
      total += size
  return files


def bpe_as_tiktoken(tokenizer_json: pathlib.Path, path: pathlib.Path) -> None:
  """Writes the byte-level BPE vocabulary of a tokenizer.json (minus its two special tokens) as a
  tiktoken rank file, rank = id - 2."""
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
  char_to_byte, extra = {}, 0
  for b in range(256):
    if b in printable:
      char_to_byte[chr(b)] = b
    else:
      char_to_byte[chr(256 + extra)] = b
      extra += 1
  vocab = json.loads(tokenizer_json.read_text())['model']['vocab']
  lines = [
    f'{base64.b64encode(bytes(char_to_byte[c] for c in tok)).decode()} {i - 2}'
    for tok, i in sorted(vocab.items(), key=lambda kv: kv[1])
    if i >= 2
  ]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text('\n'.join(lines) + '\n')


def cpu_seconds() -> float:
  """User + system CPU seconds of this process and of its finished children (prepare's workers)."""
  import resource

  own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def bench_prepare(files, work: pathlib.Path) -> dict[str, str]:
  """Prints one row per (tokenizer, workers); returns the specs of the tokenizers."""
  from kimijax.data import bpe_train
  from kimijax.data.prepare import prepare

  text_mb = sum(f.stat().st_size for f in files) / 2**20
  specs = {'byte': 'byte'}
  if {'hf', 'tiktoken'} & set(FLAGS.tokenizers.split(',')):
    sample, taken = [], 0
    for f in files:
      if taken >= FLAGS.sample_mb * 2**20:
        break
      sample.append(f.read_text(encoding='utf-8', errors='replace'))
      taken += len(sample[-1])
    began = time.perf_counter()
    tok = bpe_train.train_bpe(sample, FLAGS.vocab)
    print(
      f'BPE of {FLAGS.vocab} ids trained on {taken / 2**20:.1f} MB in {time.perf_counter() - began:.1f} s '
      '(tokenizers trainer, both cores)',
      flush=True,
    )
    (work / 'bpe').mkdir(parents=True, exist_ok=True)
    specs['hf'] = f'hf:{bpe_train.save_bpe(tok, work / "bpe")}'
    bpe_as_tiktoken(work / 'bpe' / 'tokenizer.json', work / 'tiktoken' / 'bpe.tiktoken')
    specs['tiktoken'] = f'tiktoken:{work / "tiktoken" / "bpe.tiktoken"}'
  print(
    f'\nprepare: {len(files)} files ({FLAGS.corpus}), {text_mb:.1f} MB of text, load average before '
    f'{os.getloadavg()[0]:.2f}\n'
  )
  print('| tokenizer | workers | wall s | CPU s | MB of text / s | MB / CPU s | tokens | tokens / s |')
  print('|---|---|---|---|---|---|---|---|')
  for name in FLAGS.tokenizers.split(','):
    for workers in (int(w) for w in FLAGS.workers.split(',')):
      out = work / f'shards_{name}_{workers}'
      shutil.rmtree(out, ignore_errors=True)
      began, cpu0 = time.perf_counter(), cpu_seconds()
      result = prepare(
        [str(f) for f in files],
        out,
        tokenizer=specs[name],
        workers=workers,
        unit_mb=1.0,
        val_fraction=0.01,
        progress=False,
        log=lambda *_: None,
      )
      seconds, cpu = time.perf_counter() - began, cpu_seconds() - cpu0
      m = result['manifest']
      tokens = m['splits']['train']['tokens'] + m['splits']['validation']['tokens']
      mb = m['text_bytes'] / 2**20
      print(
        f'| {name} | {workers} | {seconds:.1f} | {cpu:.1f} | {mb / seconds:.2f} | {mb / cpu:.2f} | {tokens:,} | '
        f'{tokens / seconds:,.0f} |',
        flush=True,
      )
  return specs


def bench_loader(path: pathlib.Path, spec: str) -> None:
  import ml_collections

  from kimijax.data import default_data_config, make_loader

  print(f'\nloader: {path} ({spec}), one process\n')
  print('| shape | batch x seq_len | document_mask | ms / batch | tokens / s |')
  print('|---|---|---|---|---|')
  for name, batch, seq_len in LOADER_SHAPES:
    for mask in (False, True):
      c = ml_collections.ConfigDict({'seed': 0, 'train': {'batch_size': batch, 'seq_len': seq_len}})
      c.data = default_data_config()
      c.data.update({'source': 'shards', 'path': str(path), 'tokenizer': spec, 'document_mask': mask})
      loader = make_loader(c, 'train')
      for _ in range(3):
        next(loader)
      n = max(20, FLAGS.batches * 128 * 1024 // (batch * seq_len) // 8)
      n = min(n, FLAGS.batches)
      began = time.perf_counter()
      for _ in range(n):
        next(loader)
      seconds = (time.perf_counter() - began) / n
      loader.close()
      print(
        f'| {name} | {batch} x {seq_len} | {"on" if mask else "off"} | {seconds * 1e3:.2f} | '
        f'{batch * seq_len / seconds:,.0f} |',
        flush=True,
      )


def main(argv):
  del argv
  from experiments import runs

  tokenizers = FLAGS.tokenizers.split(',')
  packages = ['tokenizers'] if {'hf', 'tiktoken'} & set(tokenizers) else []  # trains the BPE both use
  # Host work only: no JAX backend is started (on a GPU machine it would take the GPU's memory).
  host_only = {'backend': 'none (host only)', 'device': f'{os.cpu_count()}-core host'}
  runs.print_header(packages + (['tiktoken'] if 'tiktoken' in tokenizers else []), devices_from=host_only)
  work = pathlib.Path(FLAGS.keep) if FLAGS.keep else pathlib.Path(tempfile.mkdtemp(prefix='bench_data_'))
  try:
    files = corpus_files(FLAGS.corpus, FLAGS.corpus_mb)
    specs = bench_prepare(files, work)
    prepared = FLAGS.tokenizers.split(',')
    name = 'hf' if 'hf' in prepared else prepared[0]
    workers = FLAGS.workers.split(',')[0]
    bench_loader(work / f'shards_{name}_{workers}', specs[name])
  finally:
    if not FLAGS.keep:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == '__main__':
  app.run(main)
