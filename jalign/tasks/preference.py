"""What reward-model and DPO tasks share: pair data with checks before training, and batched scoring of a held-out
set on the mesh."""
from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from jalign import parallel
from jalign.config import RunConfig
from jalign.data import preference
from jalign.data.sft import TooLong
from jalign.data.sources import DataError
from jalign.models.sharding import to_host
from jalign.parallel.distributed import say
from jalign.train.task import Setup, Task, global_batch


class PreferenceTask(Task):
  def __init__(self, cfg: RunConfig):
    super().__init__(cfg)
    self.buckets = tuple(sorted(cfg.data.buckets)) or (cfg.train.seq_len,)
    self.batch_fn = preference.pair_batch(self.buckets)
    self.stats: dict[str, preference.PairStats] = {}

  def encode(self, record, *, tok, max_length, truncation):
    return preference.encode(record, tok, max_length=max_length, truncation=truncation)

  def largest_example(self) -> dict:
    """A pair of two data.max_length sequences, the first half of each a shared prompt."""
    n = self.cfg.data.max_length
    prompt = np.zeros(n // 2, np.int32)
    side = lambda token: np.concatenate([prompt, np.full(n - n // 2, token, np.int32)])  # noqa: E731
    mask = np.concatenate([np.zeros(n // 2, np.int32), np.ones(n - n // 2, np.int32)])
    return {"chosen": side(1), "chosen_mask": mask, "rejected": side(2), "rejected_mask": mask.copy()}

  def start(self, setup: Setup) -> None:
    super().start(setup)
    self.mesh = setup.mesh
    for spec in filter(None, (self.cfg.data.train, self.cfg.data.eval)):
      self.open_source(spec, train=spec == self.cfg.data.train)

  def check(self, spec: str, source) -> None:
    """The pair checks: reported, fatal under data.pair_checks='error'; bad records stop here with file:line."""
    d = self.cfg.data
    stats, tally = preference.check_pairs(source, self.encode_fn(), limit=d.check_records,
                                          skip_bad_records=d.skip_bad_records)
    self.stats[spec] = stats
    say(f"data {spec}: {tally.summary()}")
    if d.pair_checks != "off":
      say(f"preference data {spec}: {stats.summary()}")
      problems = stats.problems(d.max_length_ratio, d.pairs_per_prompt)
      if problems and d.pair_checks == "error":
        raise DataError(f"{spec}: " + "; ".join(problems) + " (data.pair_checks='error'; 'warn' reports and "
                        "continues)")
      for p in problems:
        say(f"warning: {spec}: {p}")

  def global_batch(self, local: dict, sharding) -> dict:
    if "prompt_mask" in local and jax.process_count() > 1:  # local split widths differ: agree on the widest
      pw = local["prompt_mask"].shape[1]
      widths = multihost_utils.process_allgather(np.asarray([pw, local["tokens"].shape[2] - pw])).max(0)
      local = preference.widen_split(local, int(widths[0]), int(widths[1]))
    return global_batch(local, sharding)

  def examples(self, spec: str, limit: int = 0) -> list[dict]:
    """Encoded pairs of `spec` (the first `limit`; 0 = all), skipping those the pipeline would skip."""
    source = self.open_source(spec, train=False)
    encode = self.encode_fn()
    out = []
    for i in range(len(source) if not limit else min(limit, len(source))):
      try:
        out.append(encode(source[i]))
      except TooLong:
        continue
      except DataError:
        if not self.cfg.data.skip_bad_records:
          raise
    return out

  def map_batches(self, examples: list[dict], fn: Callable[[dict], object], what: str = "") -> list:
    """fn(device batch) for batches of train.batch_size pairs (the last one padded by repetition); returns the
    host outputs, each cut to its real rows along the leading axis. With `what`, says how far it is every 30 s."""
    rows = self.cfg.train.batch_size
    sharding = parallel.batch_sharding(self.mesh)
    outs = []
    started = shown = time.perf_counter()
    for start in range(0, len(examples), rows):
      if what and time.perf_counter() - shown > 30:
        shown = time.perf_counter()
        say(f"{what}: {start} of {len(examples)} scored ({shown - started:.0f} s)")
      chunk = examples[start:start + rows]
      host = self.batch_fn(chunk + [chunk[-1]] * (rows - len(chunk)))
      device = {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in host.items()}
      out = to_host(fn(device))
      outs.append(jax.tree.map(lambda x: x[:len(chunk)], out))
    return outs
