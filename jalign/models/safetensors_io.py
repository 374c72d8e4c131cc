"""Lazy, memory-mapped safetensors reading and crash-safe streaming writing.

Reading maps each tensor as a NumPy view of the file, so callers slice out only the shard a device needs (no full
host copy of a large model). Writing goes to `<file>.tmp` and is renamed into place when complete.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable

import ml_dtypes
import numpy as np

from jalign.core import files
from jalign.core.errors import CheckpointError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


def read_header(path: str) -> tuple[dict, int]:
  """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data section)."""
  try:
    size = os.path.getsize(path)
  except FileNotFoundError:
    raise CheckpointError(f"{path}: safetensors file not found") from None
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, 100 << 20):
      raise CheckpointError(f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size})")
    try:
      header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
  header.pop("__metadata__", None)
  data_start = 8 + n
  for name, info in header.items():
    if info.get("dtype") not in DTYPES:
      raise CheckpointError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; "
                            f"supported: {', '.join(DTYPES)}")
    begin, end = info["data_offsets"]
    expected = int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(DTYPES[info["dtype"]]).itemsize
    if end - begin != expected:
      raise CheckpointError(f"{path}: tensor {name!r} spans {end - begin} bytes, its shape {info['shape']} "
                            f"and dtype {info['dtype']} need {expected}")
    if data_start + end > size:
      raise CheckpointError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, "
                            f"file has {size}")
  return header, data_start


class LazyFile:
  """Tensors of one safetensors file as read-only memory-mapped NumPy arrays."""

  def __init__(self, path: str):
    self.path = path
    self.header, self._start = read_header(path)

  def keys(self):
    return self.header.keys()

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    begin, _ = info["data_offsets"]
    shape = tuple(info["shape"])
    if 0 in shape:
      return np.zeros(shape, DTYPES[info["dtype"]])
    return np.memmap(self.path, dtype=DTYPES[info["dtype"]], mode="r", offset=self._start + begin, shape=shape)


def write_file(path: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
               metadata: dict[str, str] | None = None) -> None:
  """Streams tensors (name, shape, dtype, producer) into `path`, one in memory at a time."""
  tensors = list(tensors)
  header: dict = {"__metadata__": metadata or {"format": "pt"}}
  offset = 0
  for name, shape, dtype, _ in tensors:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
    offset += nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as the reference writer does
  with files.atomic_open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, shape, dtype, produce in tensors:
      arr = np.ascontiguousarray(produce(), dtype=dtype)
      if arr.shape != tuple(shape):
        raise CheckpointError(f"{path}: tensor {name!r} produced shape {arr.shape}, declared {tuple(shape)}")
      f.write(arr.tobytes())
    f.flush()
    os.fsync(f.fileno())
