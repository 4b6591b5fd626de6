"""Test set-up before JAX starts: 8 fake CPU devices (for the sharding tests), quiet logs, and on
the CPU XLA's backend optimisations off (the suite's programs are tiny and many: compiling them
dominates, and LLVM's optimisation passes are most of compiling; children started through
helpers.cpu_subprocess_env inherit the flag)."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
_flags = [os.environ.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=8']
if os.environ['JAX_PLATFORMS'] == 'cpu':
  _flags.append('--xla_backend_optimization_level=0')
os.environ['XLA_FLAGS'] = ' '.join(_flags).strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from absl import logging  # noqa: E402

logging.set_verbosity(logging.WARNING)


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != 'gpu':
    skip = pytest.mark.skip(reason='needs an NVIDIA GPU')
    for item in items:
      if 'gpu' in item.keywords:
        item.add_marker(skip)
