"""The evaluation task (`configs/eval.py`): a checkpoint's held-out figures (`jalign.eval.policy.evaluate`) written
to run_dir/eval.json and printed."""
from __future__ import annotations

import dataclasses
import os

from jalign.config import RunConfig
from jalign.core import files
from jalign.eval.policy import evaluate
from jalign.parallel import distributed
from jalign.train.metrics import MetricsWriter


def run(cfg: RunConfig) -> dict:
  log = MetricsWriter(dataclasses.replace(cfg.log, jsonl=False, progress=False), cfg.run_dir, 0, 0, {})
  out = evaluate(cfg.eval, cfg.model.path, tokenizer=cfg.tokenizer, fields=cfg.data.fields(),
                 show=lambda rows: log.samples(0, rows), shown=cfg.log.samples)
  log.close()
  if distributed.is_main():
    path = os.path.join(cfg.run_dir, "eval.json")
    files.write_json(path, {"checkpoint": os.path.abspath(cfg.model.path), **out}, indent=1)
    for k, v in out.items():
      print(f"{k}: {v:.4f}", flush=True)
  return out
