"""Every repository path named in the project's .py and .md files exists.

A path is a token that starts with one of the top-level folders and ends in a file name with an
known extension (`kimijax/ops/kda.py`, `experiments/results/bench_kda.md`) or in a slash
(`kernels_pallas/kda/`). Paths relative to a results file's own folder, workdirs (`runs/...`) and
templates with placeholders (`experiments/results/NAME.md`, `kernels_pallas/<op>/`) are not
repository paths and are skipped.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOP = ('kimijax', 'kernels_pallas', 'experiments', 'configs', 'tests', 'docs')
PATH = re.compile(r'(?<![\w./-])((?:%s)/[\w./-]*[\w/])' % '|'.join(TOP))
PLACEHOLDER = re.compile(r'[A-Z]{2,}|<|\*|\{')
FILE = re.compile(r'\.(py|md|json|jsonl|png|toml|txt|sh|cfg|yaml)$')
# Paths the tests name on purpose because they do not exist.
MEANT_TO_BE_MISSING = {'configs/no_such.py'}


def _tracked_files() -> list[str]:
  out = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True, check=True).stdout
  return out.split()


def _named_paths(text: str):
  for match in PATH.finditer(text):
    path = match.group(1).rstrip('.')
    end = match.end(1)
    if PLACEHOLDER.search(path) or text[end : end + 1] in '<*{':
      continue
    if (path.endswith('/') or FILE.search(path)) and path not in MEANT_TO_BE_MISSING:
      yield path


def test_every_named_repository_path_exists():
  tracked = _tracked_files()
  existing = set(tracked) | {str(p) + '/' for f in tracked for p in pathlib.PurePosixPath(f).parents}
  missing = []
  for name in tracked:
    if not name.endswith(('.py', '.md')):
      continue
    text = (ROOT / name).read_text(encoding='utf-8')
    for path in _named_paths(text):
      if path not in existing and path.rstrip('/') + '/' not in existing:
        missing.append(f'{name}: {path}')
  assert not missing, 'paths named but not in the repository:\n' + '\n'.join(sorted(set(missing)))
