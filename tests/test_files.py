"""Atomic writes: a reader sees the old file or the whole new one; a failed write leaves the old file and no
temporary behind."""
import json
import os

import pytest

from jalign.core import files


def test_write_replaces_whole_and_failure_keeps_the_old(tmp_path):
  path = str(tmp_path / "a.json")
  files.write_json(path, {"v": 1})
  assert json.load(open(path)) == {"v": 1}
  with pytest.raises(RuntimeError):
    with files.atomic_open(path) as f:
      f.write('{"v": 2, "half')
      assert json.load(open(path)) == {"v": 1}  # not visible while being written
      raise RuntimeError("interrupted")
  assert json.load(open(path)) == {"v": 1}
  assert os.listdir(tmp_path) == ["a.json"]
  files.write_text(path, '{"v": 3}')
  assert json.load(open(path)) == {"v": 3} and os.listdir(tmp_path) == ["a.json"]


def test_binary_and_suffix(tmp_path):
  path = str(tmp_path / "x.png")
  with files.atomic_path(path, suffix=".tmp.png") as tmp:
    assert tmp.endswith(".tmp.png")
    open(tmp, "wb").write(b"\x89PNG")
  assert open(path, "rb").read() == b"\x89PNG" and os.listdir(tmp_path) == ["x.png"]
