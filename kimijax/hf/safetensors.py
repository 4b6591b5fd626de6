"""Folders of .safetensors files, read memory-mapped and written, with no dependency beyond NumPy.

    files = SafetensorsFolder('/data/Moonlight-16B-A3B')
    files.names                      # every tensor name of the folder
    w = files.get('model.norm.weight')   # np.ndarray view of the file (bf16 as ml_dtypes.bfloat16)
    write_file(path, {'model.norm.weight': w})   # one file, tensors in the order given

A .safetensors file is an 8-byte little-endian header length, a JSON header mapping each name to
its dtype, shape and byte range (after the header), then the raw little-endian bytes. A folder
holds one model.safetensors or several shards listed by model.safetensors.index.json; every file of
the folder is read, so a tensor is found whichever shard holds it. Nothing is read until get().
"""

from __future__ import annotations

import json
import pathlib

import ml_dtypes
import numpy as np

DTYPES = {
  'F64': np.float64,
  'F32': np.float32,
  'F16': np.float16,
  'BF16': ml_dtypes.bfloat16,
  'I64': np.int64,
  'I32': np.int32,
  'I16': np.int16,
  'I8': np.int8,
  'U8': np.uint8,
  'BOOL': np.bool_,
}


NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class HfError(ValueError):
  """A released checkpoint that cannot be read or mapped; the message names the file, key or tensor."""


def _header(path: pathlib.Path) -> tuple[dict, int]:
  """(the JSON header without '__metadata__', the byte offset of the data)."""
  try:
    with path.open('rb') as f:
      size = int.from_bytes(f.read(8), 'little')
      if size <= 0 or size > path.stat().st_size - 8:
        raise HfError(f'{path}: not a safetensors file (header length {size} in a file of {path.stat().st_size} bytes)')
      header = json.loads(f.read(size))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise HfError(f'{path}: not a readable safetensors file ({e})') from None
  header.pop('__metadata__', None)
  return header, 8 + size


class SafetensorsFolder:
  """The tensors of every *.safetensors file in `folder` (one or several shards)."""

  def __init__(self, folder: str | pathlib.Path):
    self.folder = pathlib.Path(folder)
    files = sorted(self.folder.glob('*.safetensors'))
    if not files:
      raise HfError(f'{self.folder}: no .safetensors file (a released checkpoint folder holds model*.safetensors)')
    self._where: dict[str, tuple[pathlib.Path, dict, int]] = {}
    for path in files:
      header, start = _header(path)
      for name, entry in header.items():
        if name in self._where:
          raise HfError(f'{path}: tensor {name!r} is also in {self._where[name][0].name}')
        self._where[name] = (path, entry, start)
    self._maps: dict[pathlib.Path, np.memmap] = {}

  @property
  def names(self) -> list[str]:
    return sorted(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._entry(name)[1]['shape'])

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as an array over the memory-mapped file (read when used)."""
    path, entry, start = self._entry(name)
    dtype = DTYPES.get(entry['dtype'])
    if dtype is None:
      raise HfError(f'{path}: tensor {name!r} has dtype {entry["dtype"]}, which kimijax does not read')
    begin, end = entry['data_offsets']
    shape = tuple(entry['shape'])
    count = int(np.prod(shape, dtype=np.int64))
    if end - begin != count * np.dtype(dtype).itemsize:
      raise HfError(f'{path}: tensor {name!r} of shape {shape} and dtype {entry["dtype"]} spans {end - begin} bytes')
    if path not in self._maps:
      self._maps[path] = np.memmap(path, dtype=np.uint8, mode='r')
    data = self._maps[path][start + begin : start + end]
    if data.size != end - begin:
      raise HfError(f'{path}: tensor {name!r} runs past the end of the file (truncated download?)')
    return data.view(dtype).reshape(shape)

  def _entry(self, name: str):
    if name not in self._where:
      raise HfError(f'{self.folder}: no tensor {name!r} in the checkpoint')
    return self._where[name]


def write_file(path: str | pathlib.Path, tensors: dict[str, np.ndarray]) -> int:
  """Writes `tensors` (C order) as one .safetensors file; returns the data bytes.
  The header is padded with spaces to a multiple of 8 bytes, so every tensor starts aligned."""
  header, offset = {}, 0
  for name, value in tensors.items():
    if value.dtype not in NAMES:
      raise HfError(f'{path}: tensor {name!r} has dtype {value.dtype}, which safetensors files do not hold')
    header[name] = {
      'dtype': NAMES[value.dtype],
      'shape': list(value.shape),
      'data_offsets': [offset, offset + value.nbytes],
    }
    offset += value.nbytes
  text = json.dumps({'__metadata__': {'format': 'pt'}, **header}, separators=(',', ':')).encode()
  text += b' ' * (-len(text) % 8)
  with open(path, 'wb') as f:
    f.write(len(text).to_bytes(8, 'little'))
    f.write(text)
    for value in tensors.values():
      f.write(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)  # little-endian hosts
  return offset
