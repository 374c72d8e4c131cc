"""Load test of the sampler and the rollout task: 10,000 prompts from a JSONL file through `configs/rollout.py`
(generate, score, write buffer parts), with the process's resident memory sampled throughout.

    python benchmarks/rollout_load.py                  # 10,000 and 1,000 prompts x 2 samples; ~3 minutes on 2 cores
    python benchmarks/rollout_load.py --prompts 2000

Memory that grows with the number of prompts would show twice: in the resident set as the parts accumulate
(printed at 10/50/100% of the parts) and in the ratio of the peak at N prompts to the peak at N/10 prompts, measured
in the same run (1.0 = flat). Also checks that every prompt's samples reached the buffer exactly once.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jalign.data.sources import open_source  # noqa: E402


def rss_mib(pid: int) -> float | None:
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 1024.0
  except OSError:
    return None
  return None


def rollout(prompts_file: str, n_prompts: int, run_dir: str, args) -> dict:
  cmd = [sys.executable, "-m", "jalign.run", "--config=configs/rollout.py", f"--config.run_dir={run_dir}",
         f"--config.rollout.prompts={prompts_file}", f"--config.rollout.limit={n_prompts}",
         f"--config.rollout.prompts_per_batch={args.per_batch}", f"--config.sampling.num_samples={args.samples}",
         f"--config.rollout.format={args.format}",
         "--config.sampling.max_new_tokens=16"]  # as the figures in benchmarks/README.md were measured
  env = {**os.environ, "TQDM_DISABLE": "1"}
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  parts_total = -(-n_prompts // args.per_batch)
  trace = []  # (seconds, parts written, RSS MiB)
  while proc.poll() is None:
    rss = rss_mib(proc.pid)
    parts = len(glob.glob(os.path.join(run_dir, "buffer", f"part-*.{args.format}")))
    if rss is not None:
      trace.append((time.perf_counter() - start, parts, rss))
    time.sleep(0.2)
  out = proc.stdout.read()
  if proc.returncode != 0:
    raise SystemExit(f"rollout of {n_prompts} prompts failed:\n{out[-3000:]}")
  seconds = time.perf_counter() - start
  at = {}
  for frac in (0.1, 0.5, 1.0):
    want = max(1, int(parts_total * frac))
    rows = [r for _, p, r in trace if p >= want] or [trace[-1][2]]
    at[frac] = rows[0]
  return {"seconds": seconds, "peak": max(r for _, _, r in trace), "at": at, "parts": parts_total,
          "records": count_records(os.path.join(run_dir, "buffer"))}


def count_records(buffer_dir: str) -> tuple[int, int]:
  """(records, distinct prompt indices) in the buffer."""
  from jalign.rl import buffer
  records = buffer.read_all(buffer_dir)
  return len(records), len({r["prompt_index"] for r in records})


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--prompts", type=int, default=10_000)
  ap.add_argument("--samples", type=int, default=2)
  ap.add_argument("--per-batch", type=int, default=256)
  ap.add_argument("--format", default="parquet", choices=("parquet", "arrayrecord"))
  args = ap.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    prompts_file = os.path.join(tmp, "prompts.jsonl")
    source = open_source(f"synthetic:arith:train:{args.prompts}")
    with open(prompts_file, "w", encoding="utf-8") as f:
      for i in range(len(source)):
        f.write(json.dumps(source[i]) + "\n")
    small_n = max(args.per_batch, args.prompts // 10)
    small = rollout(prompts_file, small_n, os.path.join(tmp, "small"), args)
    big = rollout(prompts_file, args.prompts, os.path.join(tmp, "big"), args)
  for n, r in ((small_n, small), (args.prompts, big)):
    records, distinct = r["records"]
    print(f"{n} prompts x {args.samples}: {r['seconds']:.1f} s ({n / r['seconds']:.0f} prompts/s incl. start-up), "
          f"{r['parts']} parts, {records} records from {distinct} prompts; RSS at 10/50/100% of the parts "
          f"{r['at'][0.1]:.0f} / {r['at'][0.5]:.0f} / {r['at'][1.0]:.0f} MiB, peak {r['peak']:.0f} MiB")
    assert records == n * args.samples and distinct == n, "a prompt is missing or repeated in the buffer"
  print(f"peak RSS ratio, {args.prompts} / {small_n} prompts: {big['peak'] / small['peak']:.3f} (1.0 = flat)")


if __name__ == "__main__":
  main()
