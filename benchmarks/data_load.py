"""Load test of the input pipeline: a 1M-record JSONL streamed through SFT encoding, packing and batching.

    python benchmarks/data_load.py                 # 1,000,000 records (about 60 MB); a few minutes on 2 cores
    python benchmarks/data_load.py --records 100000

Prints records/s and the process's peak resident memory after opening the file (the line index) and at the end of
one full epoch, so memory that grows with the data would show. No peer: the figure to watch is the peak RSS staying
flat while the whole file streams through.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jalign  # noqa: E402
from jalign.data import pipeline, sft  # noqa: E402
from jalign.data.sources import open_source  # noqa: E402
from jalign.tokenizers import tokenizer as tokenizer_lib  # noqa: E402

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def peak_rss_mib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux reports KiB


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--records", type=int, default=1_000_000)
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--seq-len", type=int, default=128)
  args = ap.parse_args()
  tok = tokenizer_lib.load(os.path.join(ASSETS, "arith_tokenizer"))
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "records.jsonl")
    with open(path, "w", encoding="utf-8") as f:
      for i in range(args.records):
        a, b = i % 9973, (i * 7919) % 9973
        f.write(json.dumps({"prompt": f"{a}+{b}=", "completion": f"{a + b}"}) + "\n")
    size_mib = os.path.getsize(path) / 2 ** 20
    base = peak_rss_mib()
    start = time.perf_counter()
    source = open_source(path)
    indexed = time.perf_counter() - start
    after_index = peak_rss_mib()
    encode = lambda r: sft.encode(r, tok=tok, max_length=args.seq_len)  # noqa: E731
    spec = pipeline.PipelineSpec(batch_size=args.batch, seq_len=args.seq_len, num_epochs=1, drop_remainder=False)
    ds, counters = pipeline.build(source, encode, spec)
    start = time.perf_counter()
    tokens = batches = 0
    checkpoints = []
    for batch in ds:
      batches += 1
      tokens += int((batch["segment_ids"] > 0).sum())
      if batches % 500 == 0:
        checkpoints.append(round(peak_rss_mib()))
    seconds = time.perf_counter() - start
  print(f"{args.records} records ({size_mib:.0f} MiB JSONL): index {indexed:.1f} s; one epoch {seconds:.1f} s = "
        f"{args.records / seconds:,.0f} records/s, {tokens / seconds:,.0f} tokens/s, {batches} packed batches; "
        f"skipped {counters.bad + counters.too_long}")
  print(f"peak RSS: {base:.0f} MiB before, {after_index:.0f} MiB after indexing, {peak_rss_mib():.0f} MiB at the end "
        f"(every 500 batches: {checkpoints})")


if __name__ == "__main__":
  main()
