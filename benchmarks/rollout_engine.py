"""Rollout throughput with long-tailed response lengths: continuous batching vs static batching vs transformers.

    python benchmarks/rollout_engine.py [--model DIR|FILE.gguf] [--quick]

The same model on every side (the tiny random Llama, or --model: see benchmarks/checkpoints.py), fp32, CPU; groups
of 4 samples of prompts of 16-64 whole-word tokens; each request's response length drawn from a lognormal (mean
128, sigma 1, clipped to [1, 1024]; `--quick`: mean 32, max 256): a request stops where its drawn length says, as
if it had sampled its stop token there (a per-request budget on the jalign side, a logits processor that forces
the stop token at that step for transformers). So every side generates exactly the same number of tokens, and
tokens/s compares how each spends its decode steps:

- continuous: `sampling.generate(..., slots=S)`: S cache slots refilled a group at a time as requests finish;
- static: `sampling.generate` over consecutive batches of S requests, each decoding until its longest stops;
- transformers: `generate` over the same batches (do_sample, temperature 1), stopping each row at its length.

jalign's programs are compiled in an untimed first pass (continuous: over the same requests; static: its first
batch, one program serves every batch). Sampling at temperature 1 with
top-k/top-p off. The last line prints `continuous/static tokens/s ratio: X`.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
from checkpoints import add_model_flag, prepare

GROUP = 4


def workload(ckpt, prompts: int, mean: float, cap: int, seed: int = 0):
  """Left-padded prompts [P, W] and each request's response length [P * GROUP]."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(16, 65, prompts)
  ids = np.full((prompts, 64), ckpt.pad_id, np.int64)
  mask = np.zeros((prompts, 64), np.int64)
  for i, n in enumerate(lengths):
    ids[i, 64 - n:] = rng.choice(ckpt.word_ids, n)
    mask[i, 64 - n:] = 1
  sigma = 1.0
  drawn = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, prompts * GROUP)
  return ids, mask, np.clip(np.round(drawn), 1, cap).astype(np.int32)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--quick", action="store_true", help="CI-sized: 16 prompts, mean 32 / max 256 new tokens")
  p.add_argument("--prompts", type=int, default=0, help="prompts (x 4 samples); default 64, --quick 16")
  p.add_argument("--slots", type=int, default=32, help="cache slots = the static batch size")
  p.add_argument("--skip-transformers", action="store_true")
  add_model_flag(p)
  args = p.parse_args()
  import torch
  import transformers

  from jalign import models, sampling

  mean, cap = (32, 256) if args.quick else (128, 1024)
  n_prompts = args.prompts or (16 if args.quick else 64)
  slots = args.slots
  with tempfile.TemporaryDirectory() as d:
    ckpt = prepare(args.model, d)
    hf = None if args.skip_transformers else transformers.AutoModelForCausalLM.from_pretrained(
        ckpt.path, dtype=torch.float32).eval()
    lm = models.from_pretrained(ckpt.path, dtype="float32")
  ids, mask, budgets = workload(ckpt, n_prompts, mean, cap)
  total = int(budgets.sum())
  per_batch = slots // GROUP  # prompts per static batch

  reads = {}  # the engine's decode counters

  def continuous():
    out = sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=cap, num_samples=GROUP, slots=slots,
                            budgets=budgets, stats=reads)
    return np.asarray(jax.block_until_ready(out.lengths))

  def static(batches=None):
    lengths = []
    for start in range(0, n_prompts, per_batch)[:batches]:
      rows = slice(start * GROUP, (start + per_batch) * GROUP)
      out = sampling.generate(lm, ids[start:start + per_batch], mask[start:start + per_batch], jax.random.key(0),
                              max_new_tokens=cap, num_samples=GROUP, budgets=budgets[rows])
      lengths.append(np.asarray(jax.block_until_ready(out.lengths)))
    return np.concatenate(lengths)

  def hf_generate():
    eos = ckpt.eos_id

    class StopAt(transformers.LogitsProcessor):  # the drawn length's token is the stop token
      def __init__(self, width, budget):
        self.width, self.budget = width, torch.tensor(budget)

      def __call__(self, input_ids, scores):
        at_end = (input_ids.shape[1] - self.width + 1) >= self.budget
        forced = torch.full_like(scores, -float("inf"))
        forced[:, eos] = 0.0
        scores = scores.clone()
        scores[:, eos] = -float("inf")  # and never before
        return torch.where(at_end[:, None], forced, scores)

    lengths = []
    for start in range(0, n_prompts, per_batch):
      rows = slice(start * GROUP, (start + per_batch) * GROUP)
      b_ids = np.repeat(ids[start:start + per_batch], GROUP, 0)
      b_mask = np.repeat(mask[start:start + per_batch], GROUP, 0)
      with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor(b_ids), attention_mask=torch.tensor(b_mask),
                          max_new_tokens=int(budgets[rows].max()), do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, eos_token_id=eos, pad_token_id=ckpt.pad_id,
                          logits_processor=[StopAt(b_ids.shape[1], budgets[rows])])
      new = out[:, b_ids.shape[1]:].numpy()
      lengths.append([int(np.flatnonzero(r == eos)[0]) + 1 if (r == eos).any() else len(r) for r in new])
    return np.concatenate(lengths)

  results = {}
  sides = [("continuous", continuous), ("static", static)] + ([] if hf is None else [("transformers", hf_generate)])
  for name, fn in sides:
    if name != "transformers":
      t = time.perf_counter()
      fn(1) if name == "static" else fn()  # compiles every program the timed pass uses (static: one batch's)
      compile_s = time.perf_counter() - t
    t = time.perf_counter()
    lengths = fn()
    seconds = time.perf_counter() - t
    if not np.array_equal(lengths, budgets):  # the drawn lengths are what every side generated
      raise SystemExit(f"{name}: generated lengths differ from the drawn ones in "
                       f"{int((lengths != budgets).sum())} requests")
    results[name] = seconds
    extra = f"; first pass (compiles + run) {compile_s:.1f} s" if name != "transformers" else ""
    print(f"  {name:13s} {total / seconds:8.0f} tok/s  ({total} tokens in {seconds:.1f} s{extra})", flush=True)
  longest = [int(budgets[i:i + slots].max()) for i in range(0, len(budgets), slots)]
  print(f"model: {ckpt.description}; {n_prompts} prompts x {GROUP} samples, {slots} slots; response lengths mean "
        f"{budgets.mean():.1f}, median {np.median(budgets):.0f}, max {budgets.max()} (static batches' longest: "
        f"{longest}; useful share of their decode slot-steps {total / (slots * sum(longest)):.0%}); torch "
        f"{torch.get_num_threads()} threads")
  cfg = lm.cfg
  max_len = sampling.prompt_bucket(ids.shape[1]) + cap
  kv = 2 * cfg.num_layers * slots * max_len * cfg.num_kv_heads * cfg.head_dim * 4
  print(f"KV cache of the continuous engine: {slots} slots x {max_len} positions = {kv / 2**20:.1f} MiB "
        f"(whatever the number of requests)")
  print(f"cache positions a continuous decode step reads ({reads['decode_steps']} steps): {reads['read_bound']:.0f} "
        f"with the dense form (every slot to the longest active one's bound: CPU), {reads['read_lengths']:.0f} with "
        f"the per-slot-length kernel (TPU / GPU): {reads['read_lengths'] / reads['read_bound']:.2f}x")
  if "transformers" in results:
    print(f"continuous/transformers tokens/s ratio: {results['transformers'] / results['continuous']:.2f}")
  print(f"continuous/static tokens/s ratio: {results['static'] / results['continuous']:.2f}")


if __name__ == "__main__":
  main()
