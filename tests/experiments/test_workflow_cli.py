"""The workflows' command lines as a user meets them: each --help lists the workflow's own flags
(absl shows only the flags of the program's file, so flags defined in a shared module used to
need --helpfull), and an ablation takes --config.KEY=VALUE overrides of its base config as run.py
does, refusing an unknown key or a key its arms set with one line, before any training."""

import json
import pathlib
import subprocess
import sys

import pytest
from helpers import cpu_subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
ABLATION_FLAGS = ['--scale', '--workdir', '--seeds', '--arms', '--publish']
WORKFLOWS = {
  'experiments.sweep': ['--config', '--sweep', '--seeds', '--workdir', '--publish', '--title'],
  'experiments.scaling_ladder': [
    '--config',
    '--workdir',
    '--variants',
    '--time_budget_s',
    '--publish',
    '--report_only',
    '--drop_finished_checkpoints',
    '--from_json',
  ],
  'experiments.compare_optimizers': ['--config', '--optimizers', '--seeds', '--workdir', '--publish'],
  **{
    f'experiments.ablations.{p.stem}': ABLATION_FLAGS
    for p in sorted((ROOT / 'experiments' / 'ablations').glob('*.py'))
    if p.stem not in ('__init__', 'common')
  },
}


def _env():
  return cpu_subprocess_env()


def _popen(args):
  return subprocess.Popen(
    [sys.executable, '-m', *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
  )


@pytest.fixture(scope='module')
def helps():
  procs = {module: _popen([module, '--help']) for module in WORKFLOWS}
  return {module: (proc.communicate(timeout=300), proc.returncode) for module, proc in procs.items()}


@pytest.mark.parametrize('module', list(WORKFLOWS))
def test_help_lists_the_workflows_own_flags(helps, module):
  (out, err), rc = helps[module]
  assert rc in (0, 1) and 'Traceback' not in err, err[-2000:]  # absl's --help exits with 1
  listed = out.split('\nflags:\n', 1)[-1]
  for flag in WORKFLOWS[module]:
    name = flag.removeprefix('--')
    assert f'  --{name}:' in listed or f'  --[no]{name}:' in listed, (module, flag, listed[-2000:])
  if '.ablations.' in module:
    assert 'Every ablation also takes --config.KEY=VALUE' in out


@pytest.mark.parametrize(
  'override, message',
  [
    ('--config.train.stepz=3', "ConfigError: unknown config key 'train.stepz'; known keys in 'train'"),
    ('--config.train.steps=ten', "ConfigError: train.steps='ten' is not an int"),
    ('--config.optimizer.name=adamw', "WorkflowError: --config.optimizer.name: the arms ['muon', 'muonclip'] set"),
  ],
  ids=['unknown key', 'bad type', 'an arm key'],
)
def test_ablation_overrides_are_checked_before_training(tmp_path, override, message):
  proc = _popen(['experiments.ablations.qk_clip', f'--workdir={tmp_path}', override])
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1 and message in err and 'Traceback' not in err, err[-2000:]
  assert not (tmp_path / 'runs').exists()


@pytest.mark.parametrize(
  'args, message',
  [
    (['--workdir={file}/w'], 'WorkdirError: --workdir {file}/w lies under {file}, which is a file'),
    (['--workdir={tmp}/w', '--publish={file}/x'], 'WorkflowError: --publish={file}/x: {file} is a file, not a folder'),
  ],
  ids=['workdir under a file', 'publish under a file'],
)
def test_sweep_output_paths_are_checked_before_training(tmp_path, args, message):
  file = tmp_path / 'a_file'
  file.write_text('x')
  fill = lambda text: text.format(file=file, tmp=tmp_path)
  sweep = ['experiments.sweep', '--config=configs/default.py', '--sweep=optimizer.name=adamw,muon', '--seeds=1']
  proc = _popen(sweep + [fill(a) for a in args])
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1 and fill(message) in err and 'Traceback' not in err, err[-2000:]
  assert not (tmp_path / 'w').exists()


@pytest.mark.long
def test_an_ablation_trains_under_config_overrides(tmp_path):
  small = {
    'train.steps': 2,
    'model.d_model': 32,
    'model.num_layers': 1,
    'model.num_heads': 2,
    'model.mlp_dim': 64,
    'train.seq_len': 32,
    'train.batch_size': 2,
    'train.eval_batches': 1,
    'data.source': 'mqar',
    'data.mqar_num_pairs': 4,
  }
  args = ['experiments.ablations.qk_clip', f'--workdir={tmp_path}', '--seeds=1', '--arms=muon']
  proc = _popen(args + [f'--config.{k}={v}' for k, v in small.items()])
  out, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err[-3000:]
  saved = json.loads((tmp_path / 'runs' / 'muon,seed=0' / 'config.json').read_text())
  assert saved['train']['steps'] == 2 and saved['model']['d_model'] == 32
  assert saved['optimizer']['name'] == 'muon' and saved['optimizer']['qk_clip_tau'] == 5.0  # the ablation's own
  assert (tmp_path / 'ablation.md').exists()


def test_ladder_from_json_of_a_missing_file_is_one_line(tmp_path):
  proc = _popen(['experiments.scaling_ladder', f'--from_json={tmp_path}/none.json', f'--workdir={tmp_path}/out'])
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1 and 'Traceback' not in err, err[-2000:]
  assert err.strip() == (
    f'WorkflowError: --from_json={tmp_path}/none.json: cannot read it as JSON ([Errno 2] No such file or '
    f"directory: '{tmp_path}/none.json')"
  )


def test_ladder_from_json_with_a_training_flag_is_one_line(tmp_path):
  """--from_json takes nothing that plans or trains rungs: --variants beside it is one error, not ignored."""
  proc = _popen(
    ['experiments.scaling_ladder', f'--from_json={tmp_path}/l.json', f'--workdir={tmp_path}/out', '--variants=moe']
  )
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1 and 'Traceback' not in err, err[-2000:]
  assert err.strip() == 'WorkflowError: --from_json rewrites the report of a ladder.json alone; it takes no --variants'


def test_ladder_without_a_ladder_name_is_one_line_naming_them(tmp_path):
  """configs/ladder.py holds several ladders and documents no default: without :NAME the ladder
  stops with one line listing them, before anything is written (it used to run 'smoke')."""
  proc = _popen(['experiments.scaling_ladder', '--config=configs/ladder.py', f'--workdir={tmp_path}/out'])
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 1 and 'Traceback' not in err, err[-2000:]
  assert err.strip().splitlines() == [
    "ConfigError: configs/ladder.py: give a ladder: --config=configs/ladder.py:NAME, NAME one of 'smoke', "
    "'smoke_moe', 'gpu', 'gpu_attnres', 'gpu_hybrid', 'gpu_moe'"
  ]
  assert not (tmp_path / 'out').exists()
