"""Atomic file writes: the one way jalign writes a file that a reader, a resumed run or another process may open
while it is being written. Readers see the old file or the whole new one, never a part."""
from __future__ import annotations

import contextlib
import json
import os


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = ".tmp"):
  """Yields a temporary path beside `path` to write; when the block ends without error one rename puts it in place,
  else it is removed. `suffix` keeps an extension a writer reads (".tmp.png" for matplotlib)."""
  tmp = path + suffix
  try:
    yield tmp
    os.replace(tmp, path)
  except BaseException:
    if os.path.isfile(tmp):
      os.remove(tmp)
    raise


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w"):
  """`open(path, mode)` (text as UTF-8) whose contents appear at `path` only once the block has finished."""
  with atomic_path(path) as tmp:
    with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
      yield f


def write_text(path: str, text: str) -> None:
  with atomic_open(path) as f:
    f.write(text)


def write_json(path: str, obj, **dump_kwargs) -> None:
  with atomic_open(path) as f:
    json.dump(obj, f, **dump_kwargs)
    f.write("\n")


def output_path(run_dir: str, path: str) -> str:
  """An output path resolved against the run directory (links included)."""
  return os.path.realpath(os.path.join(run_dir, path))


def inside(run_dir: str, path: str) -> bool:
  """`path` (relative to `run_dir`) resolves inside `run_dir`."""
  root = os.path.realpath(run_dir)
  return os.path.commonpath([root, output_path(run_dir, path)]) == root
