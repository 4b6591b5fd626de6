"""Test set-up: 8 fake CPU devices (for the sharding tests) before JAX starts, quiet logs."""

import os

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

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
