"""experiments/runs.py's benchmark header: every field in its order, a package that is not
installed, the command as its module, and the device fields taken from another process's."""

import pathlib
import platform
import re

import jax

from experiments import runs

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_header_holds_every_field_in_order(monkeypatch):
  script = str(ROOT / 'experiments' / 'bench' / 'bench_kda.py')
  monkeypatch.setattr(runs.sys, 'argv', [script, '--batch=1', '--impls=xla,fla', '--note=a b'])
  prov = runs.bench_provenance(['jax', 'no_such_package_kimijax'])
  assert list(prov) == ['date', 'command', 'jax', 'packages', 'backend', 'device', 'host']
  assert re.fullmatch(r'\d{4}-\d\d-\d\d \d\d:\d\d UTC', prov['date'])
  assert prov['command'] == "python -m experiments.bench.bench_kda --batch=1 --impls=xla,fla '--note=a b'"
  assert prov['jax'] == jax.__version__
  assert prov['packages'] == {'jax': jax.__version__, 'no_such_package_kimijax': 'not installed'}
  assert prov['backend'] == 'cpu'
  assert prov['device'] == f'CPU ({platform.machine()}) x {jax.device_count()}'
  assert prov['host'] == platform.node()
  assert runs.header_line(prov) == (
    f'date {prov["date"]}; command `{prov["command"]}`; jax {jax.__version__}; jax {jax.__version__}; '
    f'no_such_package_kimijax not installed; backend cpu; device {prov["device"]}; host {platform.node()}'
  )
  assert runs.hardware().startswith(prov['device'] + ' JAX device(s), ')


def test_a_parent_takes_the_device_fields_of_its_child(monkeypatch):
  monkeypatch.setattr(runs.sys, 'argv', [str(ROOT / 'experiments' / 'bench' / 'bench_compare.py'), '--rounds=1'])
  child = {'backend': 'gpu', 'device': 'NVIDIA H200 x 1', 'host': 'elsewhere'}
  prov = runs.bench_provenance(devices_from=child)
  assert (prov['backend'], prov['device'], prov['host'], prov['packages']) == (
    'gpu',
    'NVIDIA H200 x 1',
    platform.node(),
    {},
  )
  assert prov['command'] == 'python -m experiments.bench.bench_compare --rounds=1'
  assert runs.bench_provenance(devices_from={})['device'] == 'unknown'
