"""Replay buffer on disk: a directory of part files (Parquet or ArrayRecord of JSON), one per rollout batch.

Each part is written under a temporary name and renamed when complete, so an interrupted rollout leaves only whole
parts; `completed_parts` tells a restarted run which batches are already done.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Literal

from jalign.core import files
from jalign.core.errors import ConfigError, DataError
from jalign.core.sections import bounded

FORMATS = ("parquet", "arrayrecord")
_PART = re.compile(r"part-(\d{6})\.(parquet|arrayrecord)$")
FIELDS = ("prompt_index", "group_id", "sample", "prompt_ids", "response_ids", "behaviour_logprobs", "reward",
          "ground_truth", "finish_reason", "prompt", "completion", "policy", "teacher_logprobs", "teacher",
          "teacher_topk_ids", "teacher_topk_logprobs", "routes", "route_layers")


class BufferWriter:
  def __init__(self, directory: str, fmt: str = "parquet"):
    if fmt not in FORMATS:
      raise ConfigError(f"buffer format {fmt!r}; accepted: {', '.join(FORMATS)}")
    self.directory, self.fmt = directory, fmt
    os.makedirs(directory, exist_ok=True)
    for name in os.listdir(directory):  # leftovers of a part that was being written when a run died
      if name.endswith(".tmp"):
        os.remove(os.path.join(directory, name))

  def completed_parts(self) -> set[int]:
    return {int(m.group(1)) for m in map(_PART.match, os.listdir(self.directory)) if m and m.group(2) == self.fmt}

  def write(self, part: int, records: list[dict]) -> str:
    path = os.path.join(self.directory, f"part-{part:06d}.{self.fmt}")
    with files.atomic_path(path) as tmp:
      if self.fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        table = pa.Table.from_pylist(records, schema=_schema()) if records else _schema().empty_table()
        pq.write_table(table, tmp)
      else:
        import array_record.python.array_record_module as ar
        writer = ar.ArrayRecordWriter(tmp, "group_size:1")
        for r in records:
          writer.write(json.dumps(r).encode())
        writer.close()
    return path


def _schema():
  import pyarrow as pa
  return pa.schema([("prompt_index", pa.int64()), ("group_id", pa.int64()), ("sample", pa.int32()),
                    ("prompt_ids", pa.list_(pa.int32())), ("response_ids", pa.list_(pa.int32())),
                    ("behaviour_logprobs", pa.list_(pa.float32())), ("reward", pa.float32()),
                    ("ground_truth", pa.string()), ("finish_reason", pa.int32()), ("prompt", pa.string()),
                    ("completion", pa.string()), ("policy", pa.string()),
                    # with rollout.teacher: its log-probs of the response tokens, and which teacher (else null)
                    ("teacher_logprobs", pa.list_(pa.float32())), ("teacher", pa.string()),
                    # with rollout.teacher_top_k: per response token, its k likeliest tokens and their log-probs
                    ("teacher_topk_ids", pa.list_(pa.list_(pa.int32()))),
                    ("teacher_topk_logprobs", pa.list_(pa.list_(pa.float32()))),
                    # an MoE policy's: per prompt and response token, the experts it used in each of route_layers
                    # layers (layer-major, k per layer; -1 = none: the response's last token is never fed back)
                    ("routes", pa.list_(pa.list_(pa.int16()))), ("route_layers", pa.int32())])


def part_files(directory: str) -> list[str]:
  names = sorted(n for n in os.listdir(directory) if _PART.match(n))
  if not names:
    raise DataError(f"{directory}: no buffer parts (part-NNNNNN.parquet / .arrayrecord)")
  return [os.path.join(directory, n) for n in names]


def read_all(directory: str) -> list[dict]:
  """Every record of the buffer, in part order (small buffers and tests; training reads through data sources)."""
  out = []
  for path in part_files(directory):
    if path.endswith(".parquet"):
      import pyarrow.parquet as pq
      out.extend(pq.read_table(path).to_pylist())
    else:
      import array_record.python.array_record_module as ar
      reader = ar.ArrayRecordReader(path)
      out.extend(json.loads(r) for r in reader.read_all())
      reader.close()
  return out


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts: str = ""                # prompt source (same specs as data.train)
  output: str = ""                 # buffer directory inside run_dir (relative to it); "" = run_dir/buffer
  format: Literal["parquet", "arrayrecord"] = "parquet"  # replay buffer file format
  prompts_per_batch: int = bounded(16, gt=0)  # prompts sampled per part (each part one file, written whole)
  limit: int = bounded(0, ge=0)    # first N prompts only; 0 = all
  min_reward: float | None = None  # drop trajectories scoring below this
  teacher: str = ""                # a teacher (HF directory or .gguf) whose log-probs of every sampled token join the
                                   # buffer: on-policy distillation from it needs no live teacher (docs/distill.md)
  teacher_top_k: int = bounded(0, ge=0)  # with a teacher: also its k likeliest tokens at every response position
                                   # and their log-probs (temperature 1): offline KD from the buffer; 0 = none

  def check_teacher(self) -> None:
    if self.teacher_top_k and not self.teacher:
      raise ConfigError(f"config.rollout.teacher_top_k={self.teacher_top_k} needs rollout.teacher (whose top-k)")

  def check(self, task: str, run_dir: str) -> None:
    if task == "rollout" and not self.prompts:
      raise ConfigError("config.rollout.prompts: empty; give a prompt file/glob, tfds:... or synthetic:TASK:SPLIT")
    if self.output and not files.inside(run_dir, self.output):
      raise ConfigError(f"config.rollout.output={self.output!r} resolves outside run_dir={run_dir!r}: a run writes "
                        "only inside its run directory; give a path relative to it (or run_dir itself)")
