"""Asynchronous vs synchronous GRPO on the built-in task: wall time to reach the synchronous run's final held-out
accuracy.

    python benchmarks/async_grpo.py [--quick] [--staleness 1] [--eval-every 50]
    python benchmarks/async_grpo.py --staleness 2 --partial   # + partial rollouts against draining

Runs `configs/grpo.py` twice on this machine, one after the other: synchronous (grpo.async_staleness=0, the recipe
as shipped) and asynchronous (staleness k: step t trains on rollouts sampled by the policy k updates before, while
the next rollouts are generated during its update), both evaluated every `--eval-every` steps on the same 500
held-out prompts. The target is the synchronous run's final accuracy; each run's time to target is the wall time
from its first step to its first evaluation after step 0 at or above it (evaluations included). `--quick`: 40 steps, evaluated
every 20 on 100 prompts. The last line prints `sync/async wall-time-to-target ratio: X`. `--partial` (staleness >= 2)
runs the asynchronous recipe a second time with `grpo.partial_rollouts=True` (each rollout sampled a segment per
update, continued under the new weights, rather than wholly by the policy k updates before: "draining") and prints
`draining/partial wall-time-to-target ratio: X` last.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(run_dir: str, staleness: int, extra: list[str], partial: bool = False) -> list[dict]:
  cmd = [sys.executable, "-m", "jalign.run", f"--config={ROOT}/configs/grpo.py", f"--config.run_dir={run_dir}",
         f"--config.grpo.async_staleness={staleness}", f"--config.grpo.partial_rollouts={partial}",
         "--config.log.progress=False", *extra]
  proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def summary(rows: list[dict]) -> dict:
  evals = [r for r in rows if "eval/accuracy" in r]
  steps = [r for r in rows if "actor/pg_loss" in r]
  start = evals[0]["time"]  # the initial evaluation is written just before the first step
  return {"evals": [(r["step"], r["eval/accuracy"], r["time"] - start) for r in evals],
          "wall": steps[-1]["time"] - start, "final": evals[-1]["eval/accuracy"],
          "gen": sum(r.get("timing_s/gen_wait", r["timing_s/gen"]) for r in steps) / len(steps),
          "update": sum(r["timing_s/update"] for r in steps) / len(steps),
          "lag": max(r.get("rollout/policy_lag_max", 0.0) for r in steps),
          "mean_lag": sum(r.get("rollout/policy_lag", 0.0) for r in steps) / len(steps),
          "diff": max(r.get("rollout/logprob_abs_diff_mean", 0.0) for r in steps)}


def time_to(s: dict, target: float) -> float | None:
  return next((t for step, acc, t in s["evals"] if step > 0 and acc >= target), None)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true")
  p.add_argument("--staleness", type=int, default=1)
  p.add_argument("--eval-every", type=int, default=50)
  p.add_argument("--partial", action="store_true")
  args = p.parse_args()
  if args.partial and args.staleness < 2:
    p.error("--partial needs --staleness >= 2 (a rollout spans that many updates)")
  extra = [f"--config.train.eval_every={args.eval_every}"]
  if args.quick:
    extra = ["--config.train.steps=40", "--config.train.eval_every=20", "--config.grpo.eval_examples=100"]
  with tempfile.TemporaryDirectory() as d:
    sync = summary(run(os.path.join(d, "sync"), 0, extra))
    asyn = summary(run(os.path.join(d, "async"), args.staleness, extra))
    runs = [("sync (staleness 0)", sync), (f"async (staleness {args.staleness})", asyn)]
    if args.partial:
      part = summary(run(os.path.join(d, "partial"), args.staleness, extra, partial=True))
      runs.append((f"async (staleness {args.staleness}, partial rollouts)", part))
  target = sync["final"]
  for name, s in runs:
    reached = time_to(s, target)
    curve = " / ".join(f"{acc:.1%}" for _, acc, _ in s["evals"])
    print(f"{name}: held-out {curve}; final {s['final']:.1%}; wall {s['wall']:.0f} s; per step: generation (async: "
          f"waited for) {s['gen']:.3f} s, update {s['update']:.3f} s; policy lag per token: mean {s['mean_lag']:.2f}, "
          f"max {s['lag']:.0f}; max mean "
          f"|sampler - trainer log-prob| {s['diff']:.2e}; reached {target:.1%} at "
          + ("never" if reached is None else f"{reached:.0f} s"))
  t_sync, t_async = time_to(sync, target), time_to(asyn, target)
  ratio = "n/a (the async run never reached the target)" if t_async is None else f"{t_sync / t_async:.2f}"
  print(f"sync/async wall-time-to-target ratio: {ratio}")
  if args.partial:
    t_part = time_to(part, target)
    ratio = "n/a (a run never reached the target)" if t_part is None or t_async is None else f"{t_async / t_part:.2f}"
    print(f"draining/partial wall-time-to-target ratio: {ratio}")


if __name__ == "__main__":
  main()
