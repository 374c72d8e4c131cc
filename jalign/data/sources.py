"""Random-access record sources: JSONL, Parquet, ArrayRecord and prepared TFDS directories.

Every source yields plain dicts and can say where record i came from (`where(i)` -> "file:line"), so a malformed
record is reported at its place in the file. Parsing happens lazily in `__getitem__`, inside the Grain pipeline.
"""
from __future__ import annotations

import array
import bisect
import glob
import json
import os
import re
from typing import Any, Sequence

import numpy as np

from jalign.core.errors import DataError
from jalign.data import synthetic
from jalign.data.layouts import Fields, MappedSource


def _read_bytes(path: str) -> bytes:
  if path.endswith(".gz"):
    import gzip
    try:
      with gzip.open(path, "rb") as f:
        return f.read()
    except (OSError, EOFError) as e:
      raise DataError(f"{path}: not a readable gzip file ({e})") from None
  with open(path, "rb") as f:
    return f.read()


def _decode(raw: bytes, where: str) -> dict:
  try:
    record = json.loads(raw.decode("utf-8"))
  except UnicodeDecodeError as e:
    raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
  except json.JSONDecodeError as e:
    raise DataError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(record, dict):
    raise DataError(f"{where}: expected a JSON object, found {type(record).__name__}")
  return record


class JsonlSource:
  """One JSON object per line; blank lines are ignored. Line offsets are indexed once at open; a `.gz` file is
  decompressed into memory once (random access into a gzip stream would re-read it from the start)."""

  def __init__(self, path: str):
    self.path = path
    self._data = _read_bytes(path) if path.endswith(".gz") else None
    self._offsets = array.array("q")  # 8 bytes per record (a list of ints costs ~9x that)
    self._lines = array.array("q")
    lines = self._data.splitlines(keepends=True) if self._data is not None else open(path, "rb")
    offset = 0
    for lineno, line in enumerate(lines, start=1):
      if line.strip():
        self._offsets.append(offset)
        self._lines.append(lineno)
      offset += len(line)
    if self._data is None:
      lines.close()

  def __len__(self) -> int:
    return len(self._offsets)

  def where(self, i: int) -> str:
    return f"{self.path}:{self._lines[i]}"

  def __getitem__(self, i: int) -> dict:
    if self._data is not None:
      start = self._offsets[i]
      end = self._data.find(b"\n", start)
      raw = self._data[start:] if end < 0 else self._data[start:end]
    else:
      with open(self.path, "rb") as f:
        f.seek(self._offsets[i])
        raw = f.readline()
    return _decode(raw, self.where(i))


class JsonArraySource:
  """A JSON file holding one array of objects (LLaMA-Factory's and Alpaca's `.json` datasets), parsed once; each
  element is located by the line its object starts on."""

  def __init__(self, path: str, text: str):
    self.path = path
    decoder = json.JSONDecoder()
    self._records, self._lines = [], []
    i = text.index("[") + 1
    line = text.count("\n", 0, i) + 1
    while True:
      j = _skip(text, i)
      if j < len(text) and text[j] == "]":
        break
      line += text.count("\n", i, j)
      try:
        value, end = decoder.raw_decode(text, j)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: bad JSON ({e.msg} at column {e.colno})") from None
      self._records.append(value)
      self._lines.append(line)
      line += text.count("\n", j, end)
      i = _skip(text, end)
      if i >= len(text) or text[i] not in ",]":
        raise DataError(f"{path}:{line}: bad JSON (expected ',' or ']' after element {len(self._records) - 1})")
      if text[i] == "]":
        break
      line += text.count("\n", end, i + 1)
      i += 1

  def __len__(self) -> int:
    return len(self._records)

  def where(self, i: int) -> str:
    return f"{self.path}:{self._lines[i]}"

  def __getitem__(self, i: int) -> dict:
    record = self._records[i]
    if not isinstance(record, dict):
      raise DataError(f"{self.where(i)}: expected a JSON object, found {type(record).__name__}")
    return record


def _skip(text: str, i: int) -> int:
  while i < len(text) and text[i] in " \t\r\n":
    i += 1
  return i


def json_source(path: str):
  """`.json`: an array of objects, or (as many `.json` datasets are) JSON lines."""
  if path.endswith(".gz"):
    head = _read_bytes(path)
  else:
    with open(path, "rb") as f:
      head = f.read(4096)
  if head.lstrip()[:1] != b"[":
    return JsonlSource(path)
  try:
    text = _read_bytes(path).decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None
  return JsonArraySource(path, text)


class ParquetSource:
  def __init__(self, path: str):
    import pyarrow.parquet as pq  # local: only Parquet users need pyarrow loaded
    self.path = path
    try:
      self._table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several unrelated types for unreadable files
      raise DataError(f"{path}: not a readable Parquet file ({e})") from None

  def __len__(self) -> int:
    return self._table.num_rows

  def where(self, i: int) -> str:
    return f"{self.path}:row {i}"

  def __getitem__(self, i: int) -> dict:
    return _plain(self._table.slice(i, 1).to_pylist()[0])


class ArrayRecordSource:
  """ArrayRecord files whose records are UTF-8 JSON objects."""

  def __init__(self, path: str):
    import grain
    self.path = path
    self._src = grain.sources.ArrayRecordDataSource([path])

  def __len__(self) -> int:
    return len(self._src)

  def where(self, i: int) -> str:
    return f"{self.path}:record {i}"

  def __getitem__(self, i: int) -> dict:
    raw = self._src[i]
    try:
      record = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise DataError(f"{self.where(i)}: record is not UTF-8 JSON ({e})") from None
    if not isinstance(record, dict):
      raise DataError(f"{self.where(i)}: expected a JSON object, found {type(record).__name__}")
    return record


class TfdsSource:
  """A prepared TFDS dataset directory (array_record format), read with `tfds.data_source`: no TensorFlow."""

  def __init__(self, name: str, split: str, data_dir: str | None):
    import tensorflow_datasets as tfds
    self.path = f"tfds:{name}:{split}"
    try:
      self._src = tfds.data_source(name, split=split, data_dir=data_dir)
    except Exception as e:  # tfds raises many types for a missing/unprepared dataset
      raise DataError(f"{self.path} (data_dir={data_dir}): cannot open ({e})") from None

  def __len__(self) -> int:
    return len(self._src)

  def where(self, i: int) -> str:
    return f"{self.path}:example {i}"

  def __getitem__(self, i: int) -> dict:
    return _plain(self._src[i])


class ListSource:
  """Records held in memory (synthetic tasks, tests)."""

  def __init__(self, records: Sequence[dict], name: str = "<memory>"):
    self._records = list(records)
    self.path = name

  def __len__(self) -> int:
    return len(self._records)

  def where(self, i: int) -> str:
    return f"{self.path}:{i}"

  def __getitem__(self, i: int) -> dict:
    return self._records[i]


class ConcatSource:
  """Several sources as one, index by index."""

  def __init__(self, sources: Sequence[Any]):
    if not sources:
      raise DataError("no data files matched")
    self.sources = list(sources)
    self._ends = list(np.cumsum([len(s) for s in sources]))

  def __len__(self) -> int:
    return int(self._ends[-1]) if self._ends else 0

  def _locate(self, i: int):
    k = bisect.bisect_right(self._ends, i)
    return self.sources[k], i - (int(self._ends[k - 1]) if k else 0)

  def where(self, i: int) -> str:
    src, j = self._locate(i)
    return src.where(j)

  def __getitem__(self, i: int) -> dict:
    src, j = self._locate(i)
    return src[j]


def _plain(value):
  """numpy/bytes values (TFDS, Arrow) as plain Python: bytes -> str, arrays -> lists."""
  if isinstance(value, dict):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (bytes, np.bytes_)):
    return bytes(value).decode("utf-8")
  if isinstance(value, np.ndarray):
    return [_plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, np.generic):
    return value.item()
  return value


FORMATS = {".jsonl": JsonlSource, ".json": json_source, ".parquet": ParquetSource,
           ".arrayrecord": ArrayRecordSource, ".array_record": ArrayRecordSource}


def open_source(spec: str, fields: Fields = Fields()) -> Any:
  """`spec`: a file, a glob or a comma-separated list of them (.jsonl, .json, .parquet, .arrayrecord; .jsonl.gz,
  .json.gz); `tfds:NAME[:SPLIT]@DATA_DIR`; or `synthetic:TASK[:SPLIT]` (built-in tasks, see jalign.data.synthetic).
  A trailing `[start:stop]` (records, or percent of them: `[:-400]`, `[90%:]`) takes a contiguous slice, so one file
  gives a training and a held-out split. Records pass through `fields` (jalign.data.layouts: GSM8K, MATH,
  HH-RLHF, ... mapped onto TRL's layouts)."""
  m = _SLICE.match(spec)
  source = _open(m.group(1) if m else spec)
  if m:
    n = len(source)
    bounds = [_bound(v, n, spec) for v in m.group(2, 3)]
    source = SliceSource(source, *slice(*bounds).indices(n)[:2])
    if not len(source):
      raise DataError(f"data spec {spec!r}: the slice selects none of the {n} records")
  return MappedSource(source, fields)


_SLICE = re.compile(r"^(.*)\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\]$")


def _bound(value: str | None, n: int, spec: str) -> int | None:
  if value is None:
    return None
  if value.endswith("%"):
    pct = int(value[:-1])
    if not -100 <= pct <= 100:
      raise DataError(f"data spec {spec!r}: {value} is not a percentage in [-100%, 100%]")
    return round(n * pct / 100)
  return int(value)


class SliceSource:
  """Records start .. stop-1 of another source."""

  def __init__(self, source, start: int, stop: int):
    self.source, self.start, self.stop = source, start, max(start, stop)
    self.path = getattr(source, "path", "<data>")

  def __len__(self) -> int:
    return self.stop - self.start

  def where(self, i: int) -> str:
    return self.source.where(self.start + i)

  def __getitem__(self, i: int) -> dict:
    if not 0 <= i < len(self):
      raise IndexError(i)
    return self.source[self.start + i]


def _open(spec: str) -> Any:
  if spec.startswith("tfds:"):
    body, _, data_dir = spec[len("tfds:"):].partition("@")
    name, _, split = body.partition(":")
    return TfdsSource(name, split or "train", data_dir or None)
  if spec.startswith("synthetic:"):  # synthetic:TASK[:SPLIT[:N]]
    task, split, n = (spec[len("synthetic:"):].split(":") + ["", ""])[:3]
    if task not in synthetic.TASKS or not (n.isdigit() or not n):
      raise DataError(f"data spec {spec!r}: accepted synthetic:TASK[:SPLIT[:N]], TASK one of "
                      f"{', '.join(synthetic.TASKS)} (N a count)")
    split = split or "train"
    return ListSource(synthetic.TASKS[task](split, int(n) if n else None), name=f"synthetic:{task}:{split}")
  sources = []
  for part in spec.split(","):
    files = sorted(glob.glob(part.strip())) if any(c in part for c in "*?[") else [part.strip()]
    if not files:
      raise DataError(f"data spec {part!r}: no file matches")
    for f in files:
      ext = os.path.splitext(f[:-3] if f.endswith(".gz") else f)[1].lower()
      if ext not in FORMATS or (f.endswith(".gz") and ext not in (".jsonl", ".json")):
        raise DataError(f"{f}: unknown data file type {ext!r}; accepted: {', '.join(FORMATS)} (.jsonl and .json "
                        "also gzipped), tfds:..., "
                        "synthetic:...")
      if not os.path.exists(f):
        raise DataError(f"{f}: data file not found")
      sources.append(FORMATS[ext](f))
  return sources[0] if len(sources) == 1 else ConcatSource(sources)
