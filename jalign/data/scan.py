"""A dataset read once before training: how many records a run keeps, and why it drops the others.

Every task reads (the first `data.check_records` of) its data this way at start and prints the tally, so records
dropped as too long or skipped as malformed are counted, with the longest length and the first reason, before the
first step; data that yields nothing ends the run here instead of leaving the loader searching forever.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jalign.data.sft import TooLong
from jalign.data.sources import DataError


@dataclasses.dataclass
class Tally:
  """Counts of one read of a source: `kept` + `too_long` + `bad` = `read` (of `total`)."""
  noun: str = "records"            # what a record is to the task: records, pairs, prompts
  limit_key: str = "data.max_length"  # the config key of the length limit
  total: int = 0                   # records in the source
  read: int = 0                    # records read (the first `read`)
  kept: int = 0
  too_long: int = 0
  longest: int = 0                 # tokens of the longest record dropped as too long
  limit: int = 0                   # the limit it exceeded
  first_long: str = ""             # "file:line: reason" of the first record dropped as too long
  bad: int = 0                     # malformed records skipped (data.skip_bad_records)
  first_bad: str = ""              # "file:line: reason" of the first of them

  def summary(self) -> str:
    """'read 50 of 50 pairs: kept 18, dropped 32 (32 too long: longest 812 tokens, data.max_length=512; the first:
    pairs.jsonl:3: ...)'."""
    read = f"read {self.read} of {self.total} {self.noun}"
    if self.read < self.total:
      read += f" (data.check_records={self.read})"
    reasons = []
    if self.too_long:
      reasons.append(f"{self.too_long} too long: longest {self.longest} tokens, {self.limit_key}={self.limit}; the "
                     f"first: {self.first_long}")
    if self.bad:
      reasons.append(f"{self.bad} malformed, skipped by data.skip_bad_records; the first: {self.first_bad}")
    dropped = self.too_long + self.bad
    return f"{read}: kept {self.kept}, dropped {dropped}" + (f" ({'; '.join(reasons)})" if reasons else "")


def where_error(source, index: int, error: Exception) -> str:
  """`file:line: message` for a record's error (the message may name its place already)."""
  where = source.where(index)
  text = str(error)
  return text if text.startswith(where.split(":")[0]) else f"{where}: {text}"


def scan(source, encode: Callable[[dict], object], *, limit: int = 0, skip_bad_records: bool | None = False,
         noun: str = "records", limit_key: str = "data.max_length",
         on_kept: Callable[[int, dict, object], None] | None = None, error: type = DataError) -> Tally:
  """Encodes (the first `limit`, 0 = all) records of `source` once, calling `on_kept(index, record, example)` for
  each kept one. A malformed record is a DataError naming file:line (counted instead under `skip_bad_records`); a
  source that keeps nothing is a DataError with the tally."""
  if not len(source):
    raise DataError(f"{getattr(source, 'path', 'data source')}: the dataset is empty")
  tally = Tally(noun=noun, limit_key=limit_key, total=len(source))
  for i in range(len(source) if not limit else min(limit, len(source))):
    tally.read += 1
    try:
      record = source[i]
      example = encode(record)
    except TooLong as e:
      tally.too_long += 1
      tally.longest, tally.limit = max(tally.longest, e.length), e.limit
      tally.first_long = tally.first_long or where_error(source, i, e)
      continue
    except DataError as e:
      if not skip_bad_records:
        hint = "" if skip_bad_records is None else " (set data.skip_bad_records=True to skip such records)"
        e.args = (where_error(source, i, e) + hint,)  # the same error (a PromptError stays one), placed
        raise e.with_traceback(None) from None
      tally.bad += 1
      tally.first_bad = tally.first_bad or where_error(source, i, e)
      continue
    tally.kept += 1
    if on_kept is not None:
      on_kept(i, record, example)
  if not tally.kept:
    raise error(f"{getattr(source, 'path', 'data source')}: no usable {noun}: {tally.summary()}")
  return tally
