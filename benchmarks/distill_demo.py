"""Distillation on the built-in task: held-out accuracy against wall time for on-policy distillation, GKD, offline KD
and GRPO itself, each starting from the shipped tiny policy (66.4%).

    python benchmarks/distill_demo.py [--teacher runs/dpo/hf] [--steps on_policy=300,gkd=1000,offline=700,grpo=1300]

The teacher is the policy configs/dpo.py exports (built first when --teacher does not exist: ~7-10 minutes). Each
method runs `python -m jalign.run` with its config (configs/distill.py:MODE, configs/grpo.py) in its own run
directory under runs/distill_demo, one after the other on the same cores; every export is then scored by the eval
task (greedy pass@1 on the 500 held-out prompts). GRPO logs its held-out accuracy every 50 steps, so the table also
says how many GRPO steps (and seconds) reach each distilled student's accuracy.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "runs", "distill_demo")


def run(args: list[str]) -> float:
  """`python -m jalign.run ARGS` from the repository root; its wall seconds (an error ends the benchmark)."""
  t = time.time()
  proc = subprocess.run([sys.executable, "-m", "jalign.run", *args, "--config.log.progress=False"], cwd=ROOT,
                        capture_output=True, text=True)
  if proc.returncode:
    sys.exit(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
  return time.time() - t


def accuracy(hf_dir: str, name: str) -> float:
  out = os.path.join(OUT, "eval_" + name)
  shutil.rmtree(out, ignore_errors=True)
  run(["--config=configs/eval.py", f"--config.model.path={hf_dir}", f"--config.run_dir={out}",
       "--config.eval.num_samples=0", "--config.eval.sft_data="])
  return json.load(open(os.path.join(out, "eval.json")))["eval/accuracy"]


def curve(run_dir: str, started: float) -> list[tuple[int, float, float]]:
  """(step, seconds since the command started, held-out accuracy) of a run's in-run evaluations."""
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return [(r["step"], r["time"] - started, r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--teacher", default=os.path.join(ROOT, "runs", "dpo", "hf"))
  p.add_argument("--steps", default="on_policy=300,gkd=1000,offline=700,grpo=1300")
  a = p.parse_args()
  steps = dict((k, int(v)) for k, v in (kv.split("=") for kv in a.steps.split(",")))
  if not os.path.exists(os.path.join(a.teacher, "config.json")):
    print(f"building the teacher: configs/dpo.py -> {a.teacher}", flush=True)
    run(["--config=configs/dpo.py", f"--config.run_dir={os.path.dirname(a.teacher)}"])
  teacher = accuracy(a.teacher, "teacher")
  results = {}
  for method, n in steps.items():
    run_dir = os.path.join(OUT, method)
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no earlier metrics or checkpoints
    if method == "grpo":
      args = ["--config=configs/grpo.py", "--config.train.eval_every=50"]
    else:
      args = [f"--config=configs/distill.py:{method}", f"--config.distill.teacher={a.teacher}"]
    started = time.time()
    seconds = run([*args, f"--config.run_dir={run_dir}", f"--config.train.steps={n}"])
    results[method] = dict(steps=n, seconds=seconds, accuracy=accuracy(os.path.join(run_dir, "hf"), method),
                           started=started)
    print(method, results[method], flush=True)
  grpo = curve(os.path.join(OUT, "grpo"), results["grpo"]["started"]) if "grpo" in results else []
  print(f"\nteacher (configs/dpo.py): {teacher:.1%}; student: the shipped tiny policy (66.4%)\n")
  print("| method | steps | wall time | held-out accuracy | GRPO at that wall time | GRPO to that accuracy |")
  print("| --- | --- | --- | --- | --- | --- |")
  for method, r in results.items():
    at_time = same = ""
    if method != "grpo" and grpo:
      at_time = next((f"{acc:.1%} (step {s})" for s, t, acc in reversed(grpo) if t <= r["seconds"]), "")
      same = next((f"{s} steps, {t:.0f} s" for s, t, acc in grpo if acc >= r["accuracy"]),
                  f"not within {steps['grpo']} steps")
    print(f"| {method} | {r['steps']} | {r['seconds']:.0f} s | {r['accuracy']:.1%} | {at_time} | {same} |")
  if grpo:
    print("\nGRPO's held-out accuracy by step (seconds): " + ", ".join(f"{s}: {acc:.1%} ({t:.0f} s)"
                                                                     for s, t, acc in grpo))
  json.dump({"teacher": teacher, "results": results, "grpo_curve": grpo},
            open(os.path.join(OUT, "results.json"), "w"), indent=1)


if __name__ == "__main__":
  main()
