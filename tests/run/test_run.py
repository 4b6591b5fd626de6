"""run.py as a user types it: each mistake ends in one message naming the problem and a
non-zero exit, without a Python traceback; --mode=config prints the config and parameter counts;
--help lists every config file's variants. The commands run in parallel subprocesses."""

import ast
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from helpers import cpu_subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY_FLAGS = [
  '--config.model.d_model=64',
  '--config.model.num_layers=2',
  '--config.model.num_heads=2',
  '--config.model.mlp_dim=128',
  '--config.train.seq_len=64',
  '--config.train.batch_size=4',
  '--config.train.eval_batches=1',
  '--config.train.plot=False',
]


def _env():
  return cpu_subprocess_env()


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _cases(tmp: pathlib.Path) -> dict:
  """name -> (argv after the script, what the message must contain)."""
  a_file = tmp / 'a_file'
  a_file.write_text('not a folder')
  no_run = tmp / 'not_a_run'
  no_run.mkdir()
  bad_json, not_config = tmp / 'bad_json', tmp / 'not_config'
  for folder, text in ((bad_json, '{"model": {"d_model": 6'), (not_config, '{"model": {"d_modle": 64}}')):
    folder.mkdir()
    (folder / 'config.json').write_text(text)
  run = [sys.executable, str(ROOT / 'run.py')]
  gen = run + ['--mode=generate', f'--workdir={no_run}']
  return {
    'missing config file': (
      run + ['--config=configs/no_such.py', f'--workdir={tmp}/w1'],
      "config file 'configs/no_such.py' not found",
    ),
    'unknown variant': (
      run + ['--config=configs/default.py:gqa2', f'--workdir={tmp}/w2'],
      "unknown variant 'gqa2'; allowed: 'gqa', 'nope'",
    ),
    'workdir is a file': (
      run + ['--config=configs/default.py', f'--workdir={a_file}'] + TINY_FLAGS,
      f'--workdir {a_file} exists and is not a folder',
    ),
    'workdir under a file': (
      run + ['--config=configs/default.py', f'--workdir={a_file}/run'] + TINY_FLAGS,
      f'--workdir {a_file}/run lies under {a_file}, which is a file',
    ),
    'config.json not json': (
      run + ['--mode=eval', f'--workdir={bad_json}'],
      f'CheckpointError: {bad_json}/config.json is not readable JSON',
    ),
    'config.json of unknown keys': (
      run + ['--mode=generate', f'--workdir={not_config}'],
      f"CheckpointError: {not_config}/config.json: unknown config key 'model.d_modle'",
    ),
    'max_new_tokens': (gen + ['--max_new_tokens=0'], '--max_new_tokens=0 must be positive'),
    'top_k': (gen + ['--top_k=-1'], '--top_k=-1 must be >= 0'),
    'num_samples': (gen + ['--num_samples=0'], '--num_samples=0 must be positive'),
    'temperature': (gen + ['--temperature=-0.5'], '--temperature=-0.5 must be >= 0'),
    'prompt not utf-8': (gen + [os.fsdecode(b'--prompt=abc\xff\xfe')], '--prompt is not valid UTF-8'),
    'generate without a run': (gen, 'config.json not found'),
    'eval without a run': (run + ['--mode=eval', f'--workdir={no_run}'], 'config.json not found'),
    'init_from missing': (
      run
      + ['--config=configs/default.py', f'--workdir={tmp}/init', f'--config.train.init_from={tmp}/nowhere']
      + TINY_FLAGS,
      f"CheckpointError: train.init_from='{tmp}/nowhere': no such folder",
    ),
    'export with a config': (
      run + ['--mode=export', '--config=configs/default.py', f'--workdir={no_run}', f'--export_dir={tmp}/hf2'],
      "--mode=export writes DIR's checkpoint under DIR's own config.json; drop --config",
    ),
    'export without a folder': (run + ['--mode=export', f'--workdir={no_run}'], '--export_dir=OUT is required'),
    'export without a run': (
      run + ['--mode=export', f'--workdir={no_run}', f'--export_dir={tmp}/hf'],
      'config.json not found',
    ),
    'plot_attnres on a non-run': (
      [sys.executable, str(ROOT / 'experiments/tools/plot_attnres.py'), f'--workdir={no_run}'],
      f'--workdir={no_run}: {no_run}/config.json not found',
    ),
    'nan stop': (
      run
      + ['--config=configs/default.py', f'--workdir={tmp}/nan']
      + TINY_FLAGS
      + [
        '--config.optimizer.learning_rate=1e6',
        '--config.train.grad_clip=0.0',
        '--config.optimizer.warmup_steps=0',
        '--config.train.steps=30',
        '--config.train.eval_every=1000',
      ],
      'NonFiniteError: loss or gradients became NaN/Inf at step',
    ),
    'tokamax off the gpu': (
      run
      + ['--config=configs/default.py', f'--workdir={tmp}/tk']
      + TINY_FLAGS
      + ['--config.model.attn_impl=tokamax', '--config.model.compute_dtype=bfloat16'],
      "ConfigError: attention impl='tokamax' needs an NVIDIA GPU",
    ),
    'kda kernels head dim': (
      run
      + ['--config=configs/default.py', f'--workdir={tmp}/kh']
      + TINY_FLAGS
      + ['--config.model.layer_pattern=KA', '--config.model.kda_head_dim=24', '--config.model.short_conv_impl=pallas'],
      "ConfigError: model.short_conv_impl='pallas' needs the KDA head dim",
    ),
    'mesh needs more cpu devices': (
      run + ['--config=configs/default.py', f'--workdir={tmp}/mesh', '--config.mesh.data=2'] + TINY_FLAGS,
      'on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=2 (set before the command) makes 2 CPU devices',
    ),
    # A GPU-sized config (x4 its batch, beyond any CPU host) stops on its memory in seconds, before
    # compiling for minutes into an XLA out-of-memory error, and creates no workdir.
    'gpu-sized step on a cpu': (
      run + ['--config=configs/bench_350m.py:xla', f'--workdir={tmp}/big', '--config.train.batch_size=64'],
      'MemoryLimitError: the train step at train.batch_size=64 x train.seq_len=4096 needs about',
    ),
    # The GPU attention's message does not suggest model.attn_impl='xla', which cannot fit either.
    'gpu config on a cpu': (
      run + ['--config=configs/bench_350m.py', f'--workdir={tmp}/gpu', '--config.train.batch_size=64'],
      "ConfigError: attention impl='gpu' needs an NVIDIA GPU, but JAX runs on 'cpu' here; "
      "with model.attn_impl='xla' the train step at train.batch_size=64 x train.seq_len=4096 needs about",
    ),
    'peers never come': (
      run
      + [
        '--config=configs/default.py',
        f'--workdir={tmp}/mp',
        '--num_processes=2',
        '--process_id=0',
        f'--coordinator_address=127.0.0.1:{_free_port()}',
        '--peer_timeout_s=3',
      ]
      + TINY_FLAGS,
      'process 0 of 2 could not join the others',
    ),
  }


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('cli')
  cases = _cases(tmp)
  procs = {
    name: subprocess.Popen(
      argv, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors='replace'
    )
    for name, (argv, _) in cases.items()
  }
  out = {}
  for name, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=300)
    out[name] = (proc.returncode, stdout, stderr, cases[name][1])
  out['tmp'] = tmp
  return out


CASE_NAMES = [
  'missing config file',
  'unknown variant',
  'workdir is a file',
  'workdir under a file',
  'config.json not json',
  'config.json of unknown keys',
  'max_new_tokens',
  'top_k',
  'num_samples',
  'temperature',
  'prompt not utf-8',
  'generate without a run',
  'eval without a run',
  'init_from missing',
  'export with a config',
  'export without a folder',
  'export without a run',
  'plot_attnres on a non-run',
  'nan stop',
  'tokamax off the gpu',
  'kda kernels head dim',
  'mesh needs more cpu devices',
  'gpu-sized step on a cpu',
  'gpu config on a cpu',
  'peers never come',
]


@pytest.mark.parametrize('name', CASE_NAMES)
def test_one_clear_message_and_nonzero_exit(results, name):
  rc, stdout, stderr, expected = results[name]
  assert rc not in (0, None), (name, rc)
  assert expected in stderr, (name, stderr[-2000:])
  assert 'Traceback' not in stderr and 'Fatal Python error' not in stderr, (name, stderr[-3000:])


def test_a_run_refused_on_its_memory_leaves_no_workdir(results):
  assert not (results['tmp'] / 'big').exists() and not (results['tmp'] / 'gpu').exists()


def test_a_run_refused_on_its_init_from_leaves_no_workdir(results):
  assert not (results['tmp'] / 'init').exists()


@pytest.mark.parametrize('mode', ['eval', 'generate', 'export'])
def test_a_config_override_without_config_is_one_line_not_ignored(tmp_path, mode):
  """--mode=eval|generate|export take DIR/config.json as it is without --config: a --config.KEY=V
  there used to be dropped without a word (an eval at the trained length where a longer one was
  asked for); now one UsageError line naming the key, before anything is read."""
  argv = [
    sys.executable,
    str(ROOT / 'run.py'),
    f'--mode={mode}',
    f'--workdir={tmp_path}',
    '--config.train.seq_len=8192',
  ]
  proc = subprocess.run(
    argv + [f'--export_dir={tmp_path}/hf'] * (mode == 'export'),
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=120,
  )
  expected = (
    "UsageError: --config.train.seq_len: --mode=export writes DIR's checkpoint under DIR's own config.json; drop it"
    if mode == 'export'
    else f'UsageError: --config.train.seq_len needs --config: --mode={mode} without it takes DIR/config.json as it '
    f'is; give --config=configs/trained.py:{tmp_path} to change its keys'
  )
  assert proc.returncode == 1 and proc.stderr.strip() == expected, proc.stderr[-2000:]
  assert list(tmp_path.iterdir()) == []


def test_waiting_process_says_what_it_waits_for(results):
  _, stdout, _, _ = results['peers never come']
  assert re.search(r'process 0 of 2 waiting up to 3 s for every process to join at 127\.0\.0\.1:\d+', stdout)


def test_mode_config_prints_resolved_config_and_parameter_counts():
  """Parameter count of the tiny attention model against its closed form."""
  proc = subprocess.run(
    [sys.executable, str(ROOT / 'run.py'), '--mode=config', '--config=configs/default.py:gqa'] + TINY_FLAGS,
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  d, layers, mlp, vocab, heads, kv_heads = 64, 2, 128, 258, 2, 2
  head_dim = d // heads
  attention = d * d + 2 * d * kv_heads * head_dim + d * d  # q, k, v, out
  want = vocab * d + layers * (attention + 3 * d * mlp + 2 * d) + d
  total = re.search(r'total\s+([\d,]+)', proc.stdout)
  assert total and int(total.group(1).replace(',', '')) == want, proc.stdout[-1500:]
  assert 'attention_kind: gqa' in proc.stdout and 'num_kv_heads: 2' in proc.stdout
  # The mesh rules as a table (they were ~50 lines of YAML's !!python/tuple), one row per rule.
  assert '!!python' not in proc.stdout
  rules = proc.stdout.split('mesh.rules (logical axis -> mesh axes):\n', 1)[1].split('parameters:')[0].splitlines()
  from kimijax.config import DEFAULT_RULES

  shown = lambda axes: 'replicated' if axes is None else axes if isinstance(axes, str) else ', '.join(axes)
  assert [r.split(None, 1) for r in rules] == [[name, shown(axes)] for name, axes in DEFAULT_RULES]


def _allowed_variants(config_file: pathlib.Path) -> list[str]:
  """The variants a config file accepts (its VARIANTS), which its error for an unknown one lists."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(config_file.stem, config_file)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not module.VARIANTS:  # configs/trained.py:DIR takes a run folder alone
    return []
  folder = f'{ROOT}/tests/fixtures/released/moonlight,' if config_file.stem == 'released' else ''  # FOLDER first
  with pytest.raises(ValueError) as info:
    module.get_config(folder + '__no_such_variant__')
  assert re.findall(r"'(\w+)'", str(info.value).split('allowed:', 1)[1]) == list(module.VARIANTS)
  return list(module.VARIANTS)


@pytest.mark.parametrize('config_file', sorted((ROOT / 'configs').glob('*.py')), ids=lambda p: p.name)
def test_help_lists_every_variant_of_every_config_file(config_file):
  doc = ast.get_docstring(ast.parse((ROOT / 'run.py').read_text()))
  lines = doc.splitlines()
  first = next((i for i, l in enumerate(lines) if l.strip().startswith(f'configs/{config_file.name}')), None)
  assert first is not None, f'run.py --help does not list configs/{config_file.name}'
  end = next(
    (i for i in range(first + 1, len(lines)) if not lines[i].strip() or lines[i].strip().startswith('configs/')),
    len(lines),
  )
  block = '\n'.join(lines[first:end])
  for variant in _allowed_variants(config_file):
    assert re.search(rf'\b{variant}\b', block), (config_file.name, variant)


def test_compile_cache_loads_the_first_runs_programs_and_changes_no_number(tmp_path):
  """--compile_cache: a second run of the same config loads the first's compiled train step from the
  cache and logs the same metrics, bit for bit; a cache that cannot be created is a warning and the
  run trains without one."""
  env = cpu_subprocess_env()
  env.pop('JAX_COMPILATION_CACHE_DIR', None)  # it would take the flag's place
  cache = tmp_path / 'cache'
  a_file = tmp_path / 'a_file'
  a_file.write_text('')

  def train(name, cache_flag):
    workdir = tmp_path / name
    command = [sys.executable, str(ROOT / 'run.py'), '--config=configs/default.py', f'--workdir={workdir}']
    command += TINY_FLAGS + ['--config.train.steps=4', f'--compile_cache={cache_flag}']
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return (workdir / 'metrics.jsonl').read_text().splitlines(), proc.stderr

  first, _ = train('first', cache)
  assert any(p.name.startswith('jit_train_step') for p in cache.iterdir())
  second, _ = train('second', cache)
  strip = lambda lines: [re.sub(r'"tokens_per_sec": [^,}]*', '', line) for line in lines]  # the one timing
  assert strip(second) == strip(first)
  uncached, stderr = train('uncached', a_file / 'cache')
  assert f'no compilation cache at --compile_cache={a_file / "cache"}' in stderr
  assert len(uncached) == len(first)
