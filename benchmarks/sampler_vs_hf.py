"""Generation throughput: jalign's in-graph sampler vs transformers' `generate` on the same model and prompts.

    python benchmarks/sampler_vs_hf.py [--repeats 3] [--model DIR|FILE.gguf]

Same HF model on both sides (the tiny random Llama: hidden 256, 4 layers, vocab 4096; or --model, see
benchmarks/checkpoints.py), fp32, batch 16, left-padded prompts of mixed lengths 16-64, up to 128 new tokens,
sampling at temperature 1 (top-k/top-p off on both sides), 100 stop tokens so rows finish at different times (ids
100-199 of the tiny vocabulary; for --model, 100 of its whole-word tokens); CPU. Tokens/s counts generated tokens up
to and including each row's stop token. Also prints the cost of a new prompt length (a new bucket compiles; a new
length inside a bucket does not) and the KV-cache size against its formula
2 x layers x batch x (bucket + new) x kv_heads x head_dim x bytes.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np
from checkpoints import Checkpoint, add_model_flag, prepare

BATCH, MAX_NEW = 16, 128


def stop_ids(ckpt: Checkpoint) -> tuple[int, ...]:
  if ckpt.tiny:
    return tuple(range(100, 200))
  return tuple(int(i) for i in ckpt.word_ids[::len(ckpt.word_ids) // 100][:100])


def prompts(ckpt: Checkpoint, seed: int, lo: int = 16, hi: int = 64):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(lo, hi + 1, BATCH)
  width = int(lengths.max())
  ids = np.full((BATCH, width), ckpt.pad_id, np.int64)
  mask = np.zeros((BATCH, width), np.int64)
  words = ckpt.word_ids[ckpt.word_ids >= 200] if ckpt.tiny else ckpt.word_ids
  for i, n in enumerate(lengths):
    ids[i, width - n:] = rng.choice(words, n)
    mask[i, width - n:] = 1
  return ids, mask


def generated(tokens: np.ndarray, stop: tuple[int, ...]) -> int:
  """Tokens up to and including the first stop token of each row."""
  total = 0
  for row in tokens:
    hit = np.flatnonzero(np.isin(row, stop))
    total += hit[0] + 1 if len(hit) else len(row)
  return total


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeats", type=int, default=3)
  add_model_flag(p)
  args = p.parse_args()
  import torch
  import transformers

  from jalign import models, sampling

  with tempfile.TemporaryDirectory() as d:
    ckpt = prepare(args.model, d)
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    lm = models.from_pretrained(ckpt.path, dtype="float32")
  stop = stop_ids(ckpt)
  cfg = lm.cfg

  def run_jalign(ids, mask, seed):
    out = sampling.generate(lm, ids, mask, jax.random.key(seed), max_new_tokens=MAX_NEW, temperature=1.0,
                            stop_token_ids=stop)
    return np.asarray(jax.block_until_ready(out.tokens))

  def run_hf(ids, mask, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
      out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=MAX_NEW,
                        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=list(stop),
                        pad_token_id=ckpt.pad_id)
    return out[:, ids.shape[1]:].numpy()

  ids, mask = prompts(ckpt, 0)
  t = time.perf_counter()
  run_jalign(ids, mask, 0)
  first = time.perf_counter() - t
  first_bucket = sampling.prompt_bucket(ids.shape[1])
  for r in range(args.repeats):  # every timed batch's bucket compiled beforehand (compile cost: reported below)
    run_jalign(*prompts(ckpt, r + 1), 0)
  results = {}
  for name, fn in (("jalign", run_jalign), ("transformers", run_hf)):
    tokens, seconds = 0, 0.0
    for r in range(args.repeats):
      ids, mask = prompts(ckpt, r + 1)
      t = time.perf_counter()
      out = fn(ids, mask, r)
      seconds += time.perf_counter() - t
      tokens += generated(out, stop)
    results[name] = (tokens, seconds)
  (jt, js), (ht, hs) = results["jalign"], results["transformers"]
  print(f"model: {ckpt.description}; batch {BATCH}, prompts 16-64, up to "
        f"{MAX_NEW} new tokens, {args.repeats} batches; torch {torch.get_num_threads()} threads")
  print(f"  jalign        {jt / js:8.0f} tok/s  ({jt} tokens in {js:.2f} s)")
  print(f"  transformers  {ht / hs:8.0f} tok/s  ({ht} tokens in {hs:.2f} s)")
  print(f"  ratio jalign/transformers = {(jt / js) / (ht / hs):.2f}x")

  # Cost of a new prompt length: a new bucket compiles once; lengths inside a known bucket reuse the program.
  ids, mask = prompts(ckpt, 9, 70, 100)  # a bucket not seen yet
  bucket = sampling.prompt_bucket(ids.shape[1])
  t = time.perf_counter()
  run_jalign(ids, mask, 0)
  new_bucket = time.perf_counter() - t
  ids2, mask2 = prompts(ckpt, 10, 66, bucket)  # another length, same bucket
  assert sampling.prompt_bucket(ids2.shape[1]) == bucket and ids2.shape[1] != ids.shape[1]
  t = time.perf_counter()
  run_jalign(ids2, mask2, 0)
  same_bucket = time.perf_counter() - t
  print(f"  first call (compile + run, bucket {first_bucket}): {first:.2f} s; new bucket {bucket} (width "
        f"{ids.shape[1]}): {new_bucket:.2f} s; new length {ids2.shape[1]} in that bucket: {same_bucket:.2f} s")
  for bucket in (first_bucket, bucket):
    cache = models.KVCache.init(lm.cfg, BATCH, bucket + MAX_NEW)
    formula = 2 * cfg.num_layers * BATCH * (bucket + MAX_NEW) * cfg.num_kv_heads * cfg.head_dim * 4
    print(f"  KV cache, bucket {bucket}: {cache.num_bytes() / 2**20:.2f} MiB (formula {formula / 2**20:.2f} MiB "
          f"+ slot segment ids {BATCH * (bucket + MAX_NEW) * 4 / 2**20:.3f} MiB)")


if __name__ == "__main__":
  main()
