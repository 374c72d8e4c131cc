"""Prefix caching in the continuous-batching engine: prompt tokens prefilled and wall time, with and without.

    python benchmarks/prefix_cache.py [--quick]

Two workloads, CPU, fp32, one run each side after an untimed pass that compiles both sides' programs:

- tool calling (the demo of configs/agent.py): the shipped tiny policy, warm-started on the tool-use traces (the
  tiny config's 60 SFT steps, run here first), samples episodes of the calculator environment (4 per record, up to
  3 turns of 16 tokens, 128-token episodes) for 4-digit products. Each turn is one `generate` call over the running
  episodes; with the cache a turn prefills only the model's last token and the observation, and a record's four
  episodes share their first prompt's prefill.
- GRPO groups of 8: the arithmetic task's prompts, each sampled 8 times as 8 separate requests (a sampler that
  does not group them, as a multi-turn rollout's first turn does not): with the cache each prompt is prefilled once.

Prints prompt tokens, tokens prefilled and seconds per side, then `cached/uncached wall-time ratio` per workload.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def warm_start(run_dir: str) -> str:
  """The tiny agent config's SFT stage on the tool-use traces; returns the exported policy."""
  subprocess.run([sys.executable, "-m", "jalign.run", "--config=configs/agent.py:tiny", "--config.order=('sft',)",
                  f"--config.run_dir={run_dir}"], cwd=ROOT, check=True, capture_output=True)
  return os.path.join(run_dir, "1_sft", "hf")


def counting(sample_fn, stats: dict, totals: dict):
  """`sample_fn` adding each call's prompt and prefilled tokens (the engine's `stats`) to `totals`."""
  def sample(rows):
    out = sample_fn(rows)
    for k in ("prompt_tokens", "prefill_tokens"):
      totals[k] = totals.get(k, 0) + stats[k]
    return out
  return sample


def episodes(lm, tok, records, cached: bool) -> tuple[dict, float]:
  from jalign.rl.agentic import agent
  from jalign.rl.agentic import env as env_lib
  stats, totals = {}, {}
  sample = agent.sampler(lm, tok, jax.random.key(0), max_turn_tokens=16, temperature=1.0, pad_id=tok.pad_id,
                         prefix_cache=cached, stats=stats)
  start = time.perf_counter()
  out = agent.rollout(lambda: env_lib.make("calculator", fmt="compact", max_turns=3), tok, records, 4,
                      counting(sample, stats, totals), max_turn_tokens=16, max_tokens=128)
  totals["turns"] = float(out.metrics()["agent/turns/mean"])
  totals["tool_calls"] = float(out.metrics()["agent/tool_calls/mean"])
  return totals, time.perf_counter() - start


def groups(lm, tok, records, cached: bool) -> tuple[dict, float]:
  from jalign import sampling
  from jalign.data.prompts import encode_prompt, left_pad_ids
  rows = [encode_prompt(r, tok, index=i, where="", max_length=64).ids for i, r in enumerate(records) for _ in range(8)]
  ids, mask = left_pad_ids(rows, tok.pad_id)
  stats = {}
  start = time.perf_counter()
  out = sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=16, temperature=1.0,
                          stop_token_ids=(tok.eos_id,), pad_id=tok.pad_id, slots=0,
                          prefix_cache=sampling.PrefixCache() if cached else None, stats=stats)
  jax.block_until_ready(out.tokens)
  return {k: stats[k] for k in ("prompt_tokens", "prefill_tokens")}, time.perf_counter() - start


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="16 records per workload instead of 64")
  args = p.parse_args()
  from jalign import models
  from jalign.data.sources import open_source
  from jalign.tokenizers import tokenizer
  n = 16 if args.quick else 64
  with tempfile.TemporaryDirectory() as d:
    policy = warm_start(d)
    lm = models.from_pretrained(policy, dtype="float32")
    tok = tokenizer.load(policy)
  for name, run, source in (("tool calling", episodes, f"synthetic:mul:test:{n}"),
                            ("GRPO groups of 8", groups, f"synthetic:arith:test:{n}")):
    src = open_source(source)
    records = [src[i] for i in range(n)]
    for cached in (False, True):  # compiles every program either side runs
      run(lm, tok, records, cached)
    seconds = {}
    for cached in (False, True):
      counts, seconds[cached] = run(lm, tok, records, cached)
      print(f"{name}, {'cached  ' if cached else 'uncached'}: " +
            ", ".join(f"{k} {v:g}" for k, v in counts.items()) + f", {seconds[cached]:.2f} s")
    print(f"{name}: cached/uncached wall-time ratio: {seconds[True] / seconds[False]:.2f}")


if __name__ == "__main__":
  main()
