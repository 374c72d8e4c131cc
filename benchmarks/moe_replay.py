"""Routing replay on an MoE policy for the built-in task: GRPO in bf16 with and without `grpo.routing_replay`,
synchronous and with asynchronous rollouts one update stale, from the same policy and seed.

    python benchmarks/moe_replay.py [--steps 200] [--experts 8] [--noise 0.3]

The policy is the shipped tiny one (66.4%) upcycled to `--experts` experts, top 2 (`jalign.models.upcycle`: every
expert a copy of its MLP, each copy's weights times 1 + noise x N(0, 1), a new router), written to
runs/moe_replay/policy. Each run is `python -m jalign.run --config=configs/grpo.py` on it with model.dtype=bfloat16
(sampler and trainer alike), held-out accuracy every 50 steps; the table gives the initial, best and final
accuracy, the mean of rollout/routing_mismatch and of the log-prob gap between the sampler and the trainer
(rollout/logprob_abs_diff_mean, every 10 steps), the largest single-token gap, and the wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "moe_replay")
TINY = os.path.join(ROOT, "jalign", "assets", "tiny_policy")
RUNS = {"sync": [], "sync_replay": ["--config.grpo.routing_replay=True"],
        "async1": ["--config.grpo.async_staleness=1"],
        "async1_replay": ["--config.grpo.async_staleness=1", "--config.grpo.routing_replay=True"]}


def build_policy(path: str, experts: int, noise: float) -> None:
  from jalign import models
  from jalign.models.upcycle import upcycle
  dense = models.from_pretrained(TINY, dtype="float32")
  models.save_pretrained(upcycle(dense, num_experts=experts, experts_per_token=2, noise=noise, seed=0), path)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(TINY, name), os.path.join(path, name))


def run(args: list[str]) -> float:
  """`python -m jalign.run ARGS` from the repository root; its wall seconds (an error ends the benchmark)."""
  t = time.time()
  proc = subprocess.run([sys.executable, "-m", "jalign.run", *args, "--config.log.progress=False"], cwd=ROOT,
                        capture_output=True, text=True)
  if proc.returncode:
    sys.exit(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  return time.time() - t


def summary(run_dir: str, seconds: float) -> dict:
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  acc = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
  col = lambda key: [r[key] for r in rows if key in r]  # noqa: E731
  return dict(initial=acc[0], best=max(acc), final=acc[-1], mismatch=float(np.mean(col("rollout/routing_mismatch"))),
              gap_mean=float(np.mean(col("rollout/logprob_abs_diff_mean"))),
              gap_max=float(np.max(col("rollout/logprob_abs_diff_max"))), seconds=seconds)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--experts", type=int, default=8)
  p.add_argument("--noise", type=float, default=0.3)
  p.add_argument("--runs", default=",".join(RUNS))
  a = p.parse_args()
  policy = os.path.join(OUT, "policy")
  build_policy(policy, a.experts, a.noise)
  results = {}
  for name in a.runs.split(","):
    run_dir = os.path.join(OUT, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no earlier metrics or checkpoints
    seconds = run(["--config=configs/grpo.py", f"--config.model.path={policy}", "--config.model.dtype=bfloat16",
                   f"--config.run_dir={run_dir}", f"--config.train.steps={a.steps}", "--config.train.eval_every=50",
                   "--config.train.log_every=10", *RUNS[name]])
    results[name] = summary(run_dir, seconds)
    print(name, results[name], flush=True)
  print(f"\nthe tiny policy upcycled to {a.experts} experts (top 2, noise {a.noise}); GRPO bf16, {a.steps} steps\n")
  print("| run | held-out accuracy: initial -> best -> final | routing mismatch | log-prob gap mean | gap max | "
        "wall time |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, r in results.items():
    print(f"| {name} | {r['initial']:.1%} -> {r['best']:.1%} -> {r['final']:.1%} | {r['mismatch']:.2%} | "
          f"{r['gap_mean']:.4f} | {r['gap_max']:.3f} | {r['seconds']:.0f} s |")


if __name__ == "__main__":
  main()
