"""The base of every settings family and its parsing: the Pallas kernels' (kernels_pallas/<op>/settings.py)
and 'xla_blocked''s layout (kimijax.ops.moe.BlockedSettings). Plain Python, no JAX: an op may build
on it at import time.

A family's settings (tiles, warps, stages, switches) are a frozen dataclass of ints with the
measured defaults, passed from the op down to every kernel call and taken by the custom VJP and
the shared jit as a static argument (hashable). Callers change some fields with `replace`,
benchmarks and the config from text ('bt=32/warps=8', `from_string`); a key that is not a field is
an error naming it.
"""

from __future__ import annotations

import dataclasses


def parse_settings(text: str) -> dict:
  """'bt=32/warps=8' -> {'bt': 32, 'warps': 8} ('' -> {}), the benchmarks' and the config's form."""
  try:
    return {k: int(v) for k, v in (kv.split('=') for kv in text.split('/') if kv)}
  except ValueError:
    raise ValueError(f"kernel settings: expected 'key=int/key=int', got {text!r}") from None


class Settings:
  """Base of the settings families: subclasses are frozen dataclasses whose fields are ints
  (their defaults the measured ones), hashable, so that a jit or custom VJP takes them as a static
  argument. FAMILY names the family in errors; SWITCHES are the fields that are 0 or 1, every
  other field is a positive int."""

  FAMILY = 'kernels'
  SWITCHES = ()

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'{self.FAMILY}: {field.name} must be an int, got {value!r}')
      if field.name in self.SWITCHES and value not in (0, 1):
        raise ValueError(f'{self.FAMILY}: {field.name} is a switch, 0 or 1; got {value}')
      if field.name not in self.SWITCHES and value < 1:
        raise ValueError(f'{self.FAMILY}: {field.name} must be a positive int, got {value}')

  def _check_powers_of_two(self, names, minimum: int):
    """A ValueError naming the first field among `names` that is not a power of two >= minimum."""
    for name in names:
      value = getattr(self, name)
      if value < minimum or value & (value - 1):
        raise ValueError(f'{self.FAMILY}: {name} must be a power of two >= {minimum}, got {value}')

  def replace(self, **changes):
    """A copy with some fields changed; a name that is not a field is an error naming it."""
    names = [field.name for field in dataclasses.fields(self)]
    unknown = sorted(set(changes) - set(names))
    if unknown:
      raise ValueError(f'{self.FAMILY}: unknown keys {unknown}; allowed: {sorted(names)}')
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_string(cls, text: str):
    """The defaults with the fields named in text ('key=int/key=int'; '' the defaults) changed."""
    return cls().replace(**parse_settings(text))
