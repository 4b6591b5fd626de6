"""How a config key is declared, and the checks every declaration brings.

A section of the config is a dict of name -> Key (or a nested dict, a group). A Key holds the
default, one line of doc and the values the key takes; its type is the default's. From that alone
come the defaults (`defaults`), the checks of a config against the declarations (`check`: unknown
and missing keys, type, allowed values, bounds) and the typed parsing of a command-line value
(`parse_value`: an int key takes 1000 or 1e3). The declarations are in kimijax/config.py (the data
section in kimijax/data/pipeline.py); this module imports nothing of kimijax, so both can use it.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from collections.abc import Callable, Collection
from typing import Any

import ml_collections

POSITIVE = '(0, inf)'
NON_NEGATIVE = '[0, inf)'


class ConfigError(ValueError):
  """A config value or key that cannot be used; the message names the key."""


@dataclasses.dataclass(frozen=True)
class Key:
  """One config key. `allowed`: the values it takes (a mapping: its keys, e.g. an op's IMPLS);
  `bounds`: an interval such as '(0, inf)' or '[0, 1)' its value must lie in; `check(path, value)`:
  any other rule on the key alone, raising ConfigError. The type is the default's (a float key
  also takes an int)."""

  default: Any
  doc: str
  allowed: Collection | None = None
  bounds: str = ''
  check: Callable[[str, Any], None] | None = None


Section = dict  # name -> Key | Section


def defaults(section: Section) -> ml_collections.ConfigDict:
  """The ConfigDict of the declared defaults (groups as nested ConfigDicts)."""
  return ml_collections.ConfigDict(
    {name: defaults(k) if isinstance(k, dict) else k.default for name, k in section.items()}
  )


_TYPE_NAMES = {
  bool: 'a bool (True or False)',
  int: 'an int (such as 1000 or 1e3)',
  float: 'a float (such as 3e-4)',
  str: 'a string',
  tuple: 'a tuple',
}


def _type_ok(value, kind: type) -> bool:
  if kind is bool:
    return isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind is tuple:
    return isinstance(value, (tuple, list))
  return isinstance(value, kind)


_INTERVAL = re.compile(r'^([\[(])\s*(-?[\d.e+-]+|-inf)\s*,\s*(-?[\d.e+-]+|inf)\s*([\])])$')


def in_bounds(value, bounds: str) -> bool:
  """Whether value lies in the interval '[lo, hi)' (brackets: closed ends, parentheses: open)."""
  match = _INTERVAL.match(bounds)
  if not match:
    raise ValueError(f'bounds {bounds!r} is not an interval such as (0, inf) or [0, 1)')
  left, lo, hi, right = match.groups()
  lo, hi = float(lo), float(hi)
  return (value > lo or (left == '[' and value == lo)) and (value < hi or (right == ']' and value == hi))


def _bounds_text(bounds: str) -> str:
  return {POSITIVE: 'be positive', NON_NEGATIVE: 'be non-negative'}.get(bounds, f'lie in {bounds}')


def check_value(path: str, key: Key, value) -> None:
  """The declaration's checks of one value; ConfigError naming the key otherwise."""
  kind = type(key.default)
  if key.allowed is not None or kind is bool:
    allowed = list(key.allowed) if key.allowed is not None else [True, False]
    if not any(value == a and type(value) is type(a) for a in allowed):
      raise ConfigError(f'{path}={value!r} is not allowed; allowed values: {allowed}')
  elif not _type_ok(value, kind):
    raise ConfigError(f'{path}={value!r} is not {_TYPE_NAMES.get(kind, kind.__name__)}')
  if key.bounds and not in_bounds(value, key.bounds):
    raise ConfigError(f'{path}={value!r} must {_bounds_text(key.bounds)}')
  if key.check is not None:
    key.check(path, value)


def check(config: ml_collections.ConfigDict, section: Section, prefix: str = '') -> None:
  """Every key of config declared in section and every declared key present, each value checked
  against its declaration; ConfigError naming the first bad key."""
  for name in config.keys():
    path = f'{prefix}{name}'
    if name not in section:
      where = f'in {prefix[:-1]!r}' if prefix else 'here'
      raise ConfigError(f'unknown config key {path!r}; known keys {where}: {sorted(section)}')
    if isinstance(section[name], dict) != isinstance(config[name], ml_collections.ConfigDict):
      what = f'a group with keys {sorted(section[name])}' if isinstance(section[name], dict) else 'a value'
      raise ConfigError(f'config key {path!r} must be {what}')
  for name, key in section.items():
    path = f'{prefix}{name}'
    if name not in config:
      raise ConfigError(f'config key {path!r} is missing; start configs from kimijax.config.base_config()')
    if isinstance(key, dict):
      check(config[name], key, path + '.')
    else:
      check_value(path, key, config[name])


def parse_value(path: str, text: str, current):
  """A command-line value for the key at path, typed like its current value: an int key takes
  integral floats such as 1e3, a bool key true/false; ConfigError naming the key and the type."""
  kind = type(current)
  try:
    if kind is bool:
      if text.lower() in ('true', '1', 'false', '0'):
        return text.lower() in ('true', '1')
    elif kind is int:
      try:
        return int(text)
      except ValueError:
        number = float(text)
        if math.isfinite(number) and number.is_integer():
          return int(number)
    elif kind is float:
      return float(text)
    elif kind in (tuple, list):
      value = ast.literal_eval(text)
      if isinstance(value, (tuple, list)):
        return tuple(value)
    elif current is None:
      try:
        return ast.literal_eval(text)
      except (ValueError, SyntaxError):
        return text
    else:
      return kind(text)
  except (ValueError, SyntaxError):
    pass
  raise ConfigError(f'{path}={text!r} is not {_TYPE_NAMES.get(kind, kind.__name__)}')
