"""Grain pipelines: index shuffling, per-process sharding, encoding with bad-record handling, packing or bucketed
padding, batching. Iterator state (for checkpoints) covers all of it, so a resumed run sees the same data order.

Packed and bucketed batches carry `record` [B, L]: 1 + the source index of the record each token came from (0 on
padding), so a failing step can name its records (`records_of`); the loop strips it before the device.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal

import grain
import numpy as np

from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.data.layouts import Fields
from jalign.data.sft import TooLong
from jalign.data.sources import DataError


@dataclasses.dataclass
class Counters:
  """Records dropped so far (shared with the live iterator; restored from its state)."""
  bad: int = 0
  too_long: int = 0


class _DropNone(grain.IterDataset):
  """Drops the records `load` could not use; a whole pass over the source without one it could use is a
  DataError with the counts (a loader repeating forever would otherwise search for one forever)."""

  def __init__(self, parent: grain.IterDataset, counters: Counters, source):
    super().__init__(parent)
    self._counters = counters
    self._source = source

  def __iter__(self):
    return _DropNoneIterator(self._parent.__iter__(), self._counters, self._source)


class _DropNoneIterator(grain.DatasetIterator):
  def __init__(self, parent, counters: Counters, source):
    super().__init__(parent)
    self._counters = counters
    self._source = source

  def __next__(self):
    for _ in range(len(self._source)):
      item = next(self._parent)
      if item is not None:
        return item
    c = self._counters
    raise DataError(f"{getattr(self._source, 'path', 'data source')}: {len(self._source)} records in a row were "
                    f"dropped, a whole pass over the data ({c.too_long} too long for data.max_length, {c.bad} "
                    "malformed so far): nothing left to train on")

  def get_state(self):
    return {"parent": self._parent.get_state(), "bad": self._counters.bad, "too_long": self._counters.too_long}

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._counters.bad, self._counters.too_long = state["bad"], state["too_long"]


def example_length(example: dict) -> int:
  """Tokens of an encoded example (a pair: both sides) for grouping by length."""
  return sum(len(v) for v in example.values() if isinstance(v, np.ndarray) and v.ndim == 1)


class _ByLength(grain.IterDataset):
  """Examples regrouped so that each batch holds examples of similar length, as HF Trainer's `group_by_length` and
  TRL's length-grouped sampler do: `window` batches' worth are read, sorted by length, cut into batches, and those
  batches served in an order shuffled per window (a short final batch of a finite stream stays last). Padding to a
  batch's longest then costs little; the data order stays random at the scale of a window."""

  def __init__(self, parent: grain.IterDataset, batch_size: int, window: int, seed: int):
    super().__init__(parent)
    self._args = (batch_size, window, seed)

  def __iter__(self):
    return _ByLengthIterator(self._parent.__iter__(), *self._args)


class _ByLengthIterator(grain.DatasetIterator):
  def __init__(self, parent, batch_size: int, window: int, seed: int):
    super().__init__(parent)
    self._batch_size, self._window, self._seed = batch_size, window, seed
    self._buffer: list = []
    self._pos = 0
    self._index = 0          # windows filled so far
    self._start = None       # the parent's state before the window in the buffer

  def _fill(self):
    self._start = self._parent.get_state()
    items = []
    for _ in range(self._batch_size * self._window):
      try:
        items.append(next(self._parent))
      except StopIteration:
        break
    if not items:
      raise StopIteration
    order = sorted(range(len(items)), key=lambda i: example_length(items[i]))
    batches = [order[i:i + self._batch_size] for i in range(0, len(order), self._batch_size)]
    full = [b for b in batches if len(b) == self._batch_size]
    np.random.default_rng((self._seed, self._index)).shuffle(full)
    self._buffer = [items[i] for b in full + [b for b in batches if len(b) < self._batch_size] for i in b]
    self._index += 1
    self._pos = 0

  def __next__(self):
    if self._pos >= len(self._buffer):
      self._fill()
    self._pos += 1
    return self._buffer[self._pos - 1]

  def get_state(self):
    if self._pos < len(self._buffer):  # inside a window: re-read from its start, then skip what was served
      return {"parent": self._start, "window": self._index - 1, "pos": self._pos}
    return {"parent": self._parent.get_state(), "window": self._index, "pos": 0}

  def set_state(self, state):
    self._parent.set_state(state["parent"])
    self._index, self._buffer, self._pos = state["window"], [], 0
    if state["pos"]:
      self._fill()
      self._pos = state["pos"]


def pad_to(x: np.ndarray, length: int) -> np.ndarray:
  return np.pad(x, (0, length - len(x)))


def bucket_batch(buckets: tuple[int, ...]) -> Callable[[list[dict]], dict]:
  """Batches examples padded (right) to the smallest bucket that fits the longest of them, so a handful of shapes
  are ever compiled."""
  def batch(examples: list[dict]) -> dict:
    longest = max(len(e["tokens"]) for e in examples)
    length = next((b for b in buckets if b >= longest), buckets[-1])
    tokens = np.stack([pad_to(e["tokens"], length) for e in examples])
    real = np.stack([pad_to(np.ones_like(e["tokens"]), length) for e in examples])
    return {"tokens": tokens, "loss_mask": np.stack([pad_to(e["loss_mask"], length) for e in examples]),
            "segment_ids": real, "positions": np.where(real > 0, np.arange(length)[None], 0).astype(np.int32),
            "record": np.stack([pad_to(e["record"], length) for e in examples])}
  return batch


def _rename_packed(batch: dict) -> dict:
  return {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"], "segment_ids": batch["tokens_segment_ids"],
          "positions": batch["tokens_positions"], "record": batch["record"]}


def records_of(batch: dict) -> list[int]:
  """Source indices of the records in a packed or bucketed batch (empty when it does not carry them)."""
  record = batch.get("record")
  return [] if record is None else sorted(int(r) - 1 for r in np.unique(record) if r > 0)


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  batch_size: int                 # per process, per step
  seq_len: int
  packing: bool = True
  buckets: tuple[int, ...] = ()   # unpacked only; () = seq_len
  shuffle: bool = True
  seed: int = 0
  num_epochs: int | None = None   # None = repeat forever
  skip_bad_records: bool = False
  num_packing_bins: int = 0       # 0 = batch_size
  group_by_length: int = 0        # unpacked: batches of similar lengths from windows of this many batches; 0 = off
  drop_remainder: bool = True
  read_threads: int = 0           # threads reading and encoding records ahead; 0 = on demand in this thread


def build(source, encode: Callable[[dict], dict], spec: PipelineSpec, *, process_index: int = 0,
          process_count: int = 1, batch_fn: Callable[[list[dict]], dict] | None = None
          ) -> tuple[grain.IterDataset, Counters]:
  """IterDataset of batches {"tokens", "loss_mask", "segment_ids", "positions"}: int32 [batch_size, length].

  `batch_fn` (examples -> batch) replaces packing / bucketing, e.g. for preference pairs."""
  if len(source) == 0:
    raise DataError(f"{getattr(source, 'path', 'data source')}: the dataset is empty")
  counters = Counters()
  ds = grain.MapDataset.range(len(source))
  if spec.shuffle:
    ds = ds.seed(spec.seed).shuffle()
  ds = ds.repeat(spec.num_epochs)
  ds = ds[process_index::process_count]  # this host's share: same global order on every host

  def load(index) -> Any:
    index = int(index)
    try:
      example = encode(source[index])
      if "tokens" in example:  # a sequence's provenance, per token (pairs carry none)
        example["record"] = np.full(len(example["tokens"]), index + 1, np.int32)
      return example
    except TooLong:
      counters.too_long += 1
      return None
    except DataError as e:
      where = source.where(index)
      msg = str(e) if str(e).startswith(where.split(":")[0]) else f"{where}: {e}"
      if spec.skip_bad_records:
        counters.bad += 1
        return None
      raise DataError(msg + " (set data.skip_bad_records=True to skip such records)") from None

  # Reading threads help on remote file systems; locally, encoding is GIL-bound and the threads' prefetch polling
  # costs more than it saves (benchmarks/data_load.py: 5,000 vs 1,800 records/s on 2 cores with grain's 16 / 500).
  options = grain.ReadOptions(num_threads=spec.read_threads, prefetch_buffer_size=4 * spec.read_threads)
  it = _DropNone(ds.map(load).to_iter_dataset(options), counters, source)
  if spec.group_by_length and not spec.packing:
    it = _ByLength(it, spec.batch_size, spec.group_by_length, spec.seed)
  if batch_fn is not None:
    it = it.batch(spec.batch_size, drop_remainder=spec.drop_remainder, batch_fn=batch_fn)
  elif spec.packing:
    features = {"tokens": spec.seq_len, "loss_mask": spec.seq_len, "record": spec.seq_len}
    it = grain.experimental.FirstFitPackIterDataset(
        it, length_struct=features, num_packing_bins=spec.num_packing_bins or spec.batch_size, seed=spec.seed,
        shuffle_bins=spec.shuffle)
    it = it.batch(spec.batch_size, drop_remainder=spec.drop_remainder).map(_rename_packed)
  else:
    buckets = tuple(sorted(spec.buckets)) or (spec.seq_len,)
    it = it.batch(spec.batch_size, drop_remainder=spec.drop_remainder, batch_fn=bucket_batch(buckets))
  return it, counters


@dataclasses.dataclass(frozen=True)
class DataSection:
  train: str = ""                         # file / glob / list, tfds:NAME:SPLIT@DIR, or synthetic:TASK:SPLIT
  eval: str = ""                          # held-out data for eval/loss (same forms as train); "" = none
  max_length: int = bounded(512, gt=0)    # tokens per example after truncation
  # an example longer than max_length: keep its start, keep its end, or drop it
  truncation: Literal["keep_start", "keep_end", "drop"] = "keep_start"
  # SFT: several examples per row (segment ids keep them apart); False: one per row, padded
  packing: bool = True
  buckets: tuple[int, ...] = ()           # unpacked padding lengths; () = train.seq_len
  shuffle: bool = True                    # shuffle the training records (each epoch)
  # skip (and count) malformed records instead of stopping at the first with file:line
  skip_bad_records: bool = False
  read_threads: int = bounded(0, ge=0)    # grain reading threads (raise for remote storage); 0 = on demand
  num_packing_bins: int = bounded(0, ge=0)  # 0 = rows per process batch
  group_by_length: int = bounded(0, ge=0)  # unpacked training batches of similar lengths, sorted within windows of
                                          # this many batches (HF Trainer's group_by_length); 0 = data order
  pair_checks: Literal["warn", "error", "off"] = "warn"  # preference data: identical pairs, repeated prompts,
                                          # chosen/rejected length imbalance, checked before training
  max_length_ratio: float = bounded(1.5, ge=1)  # chosen/rejected mean-length ratio beyond which pair_checks reports it
  pairs_per_prompt: int = bounded(1, ge=1)  # pairs one prompt may have before pair_checks reports repeated prompts
  check_records: int = bounded(10_000, ge=0)  # records (pairs, prompts) read before the first step to count what
                                          # is kept and dropped, and by the pair checks; 0 = all
  # how a dataset's records map onto TRL's layouts (jalign.data.layouts): "auto" recognises GSM8K, MATH, HH-RLHF,
  # UltraFeedback, ShareGPT and LLaMA-Factory KTO records; "none" reads records as they are
  layout: Literal["auto", "none", "gsm8k", "math", "hh_rlhf", "ultrafeedback", "sharegpt", "kto_messages"] = "auto"
  prompt_key: str = ""                    # field holding the prompt (verl's data.prompt_key); "" = by layout
  answer_key: str = ""                    # field holding the ground truth, dotted for nested fields (verl's
                                          # "reward_model.ground_truth"); "" = by layout
  prompt_suffix: str = ""                 # appended to every prompt's last user turn (an answer-format instruction)

  def fields(self) -> Fields:
    return Fields(self.layout, self.prompt_key, self.answer_key, self.prompt_suffix)

  def check(self, task: str, seq_len: int) -> None:
    """What each task needs of its data (`seq_len`: the train section's row length)."""
    if task in ("sft", "rm", "dpo", "distill") and not self.train:
      raise ConfigError("config.data.train: empty; give a data file/glob, tfds:NAME:SPLIT@DIR or synthetic:TASK")
    if self.group_by_length and self.packing:
      raise ConfigError(f"config.data.group_by_length={self.group_by_length} groups unpacked batches by length; "
                        "packed rows have none to group: set data.packing=False or data.group_by_length=0")
    if self.buckets and max(self.buckets) > seq_len:
      raise ConfigError(f"config.data.buckets={self.buckets}: largest bucket exceeds train.seq_len={seq_len}")
    if task in ("sft", "distill") and self.packing and self.max_length > seq_len:
      raise ConfigError(f"config.data.max_length={self.max_length} exceeds config.train.seq_len={seq_len}: a packed "
                        "example must fit one row")
    if task in ("rm", "dpo"):
      if self.packing:
        raise ConfigError(f"config.data.packing=True: {task} batches whole preference pairs padded to a bucket, "
                          "not packed; set data.packing=False")
      if self.max_length > seq_len:
        raise ConfigError(f"config.data.max_length={self.max_length} exceeds config.train.seq_len={seq_len}: a "
                          "pair's sequences must fit one row")
