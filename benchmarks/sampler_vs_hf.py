"""Generation throughput: jalign's in-graph sampler vs transformers' `generate` on the same model and prompts.

    python benchmarks/sampler_vs_hf.py [--repeats 3]

HF Llama (hidden 256, 4 layers, vocab 4096, fp32), batch 16, left-padded prompts of mixed lengths 16-64, up to 128
new tokens, sampling at temperature 1 (top-k/top-p off on both sides), 100 stop tokens so rows finish at different
times; CPU. Tokens/s counts generated tokens up to and including each row's stop token. Also prints the cost of a
new prompt length (a new bucket compiles; a new length inside a bucket does not) and the KV-cache size against its
formula 2 x layers x batch x (bucket + new) x kv_heads x head_dim x bytes.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np

HIDDEN, LAYERS, VOCAB, HEADS, KV_HEADS, FFN = 256, 4, 4096, 4, 4, 688
BATCH, MAX_NEW = 16, 128
STOP = tuple(range(100, 200))


def model():
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024)
  return transformers.LlamaForCausalLM(cfg).eval()


def prompts(seed: int, lo: int = 16, hi: int = 64):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(lo, hi + 1, BATCH)
  width = int(lengths.max())
  ids = np.zeros((BATCH, width), np.int64)
  mask = np.zeros((BATCH, width), np.int64)
  for i, n in enumerate(lengths):
    ids[i, width - n:] = rng.randint(200, VOCAB, n)
    mask[i, width - n:] = 1
  return ids, mask


def generated(tokens: np.ndarray) -> int:
  """Tokens up to and including the first stop token of each row."""
  total = 0
  for row in tokens:
    hit = np.flatnonzero(np.isin(row, STOP))
    total += hit[0] + 1 if len(hit) else len(row)
  return total


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  import torch

  from jalign import models, sampling

  hf = model()
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    lm = models.from_pretrained(d)

  def run_jalign(ids, mask, seed):
    out = sampling.generate(lm, ids, mask, jax.random.key(seed), max_new_tokens=MAX_NEW, temperature=1.0,
                            stop_token_ids=STOP)
    return np.asarray(jax.block_until_ready(out.tokens))

  def run_hf(ids, mask, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
      out = hf.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=MAX_NEW,
                        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=list(STOP), pad_token_id=0)
    return out[:, ids.shape[1]:].numpy()

  ids, mask = prompts(0)
  t = time.perf_counter()
  run_jalign(ids, mask, 0)
  first = time.perf_counter() - t
  first_bucket = sampling.prompt_bucket(ids.shape[1])
  for r in range(args.repeats):  # every timed batch's bucket compiled beforehand (compile cost: reported below)
    run_jalign(*prompts(r + 1), 0)
  results = {}
  for name, fn in (("jalign", run_jalign), ("transformers", run_hf)):
    tokens, seconds = 0, 0.0
    for r in range(args.repeats):
      ids, mask = prompts(r + 1)
      t = time.perf_counter()
      out = fn(ids, mask, r)
      seconds += time.perf_counter() - t
      tokens += generated(out)
    results[name] = (tokens, seconds)
  (jt, js), (ht, hs) = results["jalign"], results["transformers"]
  print(f"model: Llama hidden {HIDDEN}, {LAYERS} layers, vocab {VOCAB}; batch {BATCH}, prompts 16-64, up to "
        f"{MAX_NEW} new tokens, {args.repeats} batches; torch {torch.get_num_threads()} threads")
  print(f"  jalign        {jt / js:8.0f} tok/s  ({jt} tokens in {js:.2f} s)")
  print(f"  transformers  {ht / hs:8.0f} tok/s  ({ht} tokens in {hs:.2f} s)")
  print(f"  ratio jalign/transformers = {(jt / js) / (ht / hs):.2f}x")

  # Cost of a new prompt length: a new bucket compiles once; lengths inside a known bucket reuse the program.
  ids, mask = prompts(9, 70, 100)  # a bucket not seen yet
  bucket = sampling.prompt_bucket(ids.shape[1])
  t = time.perf_counter()
  run_jalign(ids, mask, 0)
  new_bucket = time.perf_counter() - t
  ids2, mask2 = prompts(10, 66, bucket)  # another length, same bucket
  assert sampling.prompt_bucket(ids2.shape[1]) == bucket and ids2.shape[1] != ids.shape[1]
  t = time.perf_counter()
  run_jalign(ids2, mask2, 0)
  same_bucket = time.perf_counter() - t
  print(f"  first call (compile + run, bucket {first_bucket}): {first:.2f} s; new bucket {bucket} (width "
        f"{ids.shape[1]}): {new_bucket:.2f} s; new length {ids2.shape[1]} in that bucket: {same_bucket:.2f} s")
  for bucket in (first_bucket, bucket):
    cache = models.KVCache.init(lm.cfg, BATCH, bucket + MAX_NEW)
    formula = 2 * LAYERS * BATCH * (bucket + MAX_NEW) * KV_HEADS * (HIDDEN // HEADS) * 4
    print(f"  KV cache, bucket {bucket}: {cache.num_bytes() / 2**20:.2f} MiB (formula {formula / 2**20:.2f} MiB "
          f"+ slot segment ids {BATCH * (bucket + MAX_NEW) * 4 / 2**20:.3f} MiB)")


if __name__ == "__main__":
  main()
