"""configs/recipes/hh_dpo.py training throughput with batches grouped by length vs in data order, on a real model.

    python benchmarks/hh_dpo_grouping.py [--steps 10] [--model SmolLM2-135M-Instruct.Q4_1.gguf] [--data HH.jsonl.gz]

Runs the recipe twice as a user would (`python -m jalign.run`, one CPU device, no evaluation or checkpoints), the
same pairs and seed: `data.group_by_length=0` (each batch of 8 pairs in data order, padded to its longest) and the
recipe's `data.group_by_length=32` (batches of similar lengths). Prints real (unpadded) training tokens/s over all
steps (compilation of each new batch shape included, as a user waits for it) and over the steps after the first
`--skip`, and the ratio grouped / data order.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REALDATA = os.environ.get("JALIGN_REALDATA", os.path.join(os.path.dirname(ROOT), "shared", "realdata"))


def run(model: str, data: str, steps: int, group: int, run_dir: str) -> tuple[list[dict], float]:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  cmd = [sys.executable, "-m", "jalign.run", f"--config={ROOT}/configs/recipes/hh_dpo.py",
         f"--config.model.path={model}", f"--config.data.train={data}[:-500]", "--config.data.eval=",
         f"--config.train.steps={steps}", "--config.optim.warmup_steps=2", "--config.train.eval_every=0",
         "--config.train.log_every=1", "--config.checkpoint.every=0", "--config.checkpoint.export_hf=False",
         f"--config.data.group_by_length={group}", f"--config.run_dir={run_dir}", "--config.log.progress=False"]
  started = time.perf_counter()
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(proc.stderr[-3000:])
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return [r for r in rows if "perf/tokens_per_s" in r], time.perf_counter() - started


def rate(rows: list[dict]) -> float:
  """Real tokens over seconds, summed over the steps."""
  return sum(r["perf/tokens_per_s"] * r["perf/step_time_s"] for r in rows) / sum(r["perf/step_time_s"] for r in rows)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--skip", type=int, default=2, help="steps left out of the steady-state figure")
  p.add_argument("--model", default=os.path.join(REALDATA, "models", "smollm2-135m-instruct",
                                                 "SmolLM2-135M-Instruct.Q4_1.gguf"))
  p.add_argument("--data", default=os.path.join(REALDATA, "hh-rlhf", "helpful-base_test.jsonl.gz"))
  a = p.parse_args()
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, group in (("data order", 0), ("grouped by length", 32)):
      rows, wall = run(a.model, a.data, a.steps, group, os.path.join(tmp, str(group)))
      results[name] = (rate(rows), rate(rows[a.skip:]), wall)
      print(f"{name:18s}: {results[name][0]:7.1f} tokens/s over {len(rows)} steps, {results[name][1]:7.1f} after "
            f"step {a.skip}; wall {wall:.0f} s", flush=True)
  (all_a, steady_a, _), (all_b, steady_b, _) = results.values()
  print(f"grouped / data order: {all_b / all_a:.2f}x over all steps, {steady_b / steady_a:.2f}x after step {a.skip}")


if __name__ == "__main__":
  main()
