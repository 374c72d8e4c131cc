"""Decoder forward time against transformers on the same model and batch, and compile time with scan on vs off.

    python benchmarks/model_forward.py            # CPU defaults (a ~20M-parameter Llama, batch 8 x 128)
    python benchmarks/model_forward.py --hidden 1024 --layers 8 --batch 16 --seq 512 --dtype bfloat16

Prints jalign's jitted forward (logits) time, transformers' (PyTorch, `sdpa` attention, no_grad) time on the
identical weights, their ratio, and XLA compile time for 2 vs 16 layers with `scan_layers` on and off.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def forward_vs_transformers(args) -> None:
  import torch
  import transformers

  from jalign import models

  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(
      vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=args.hidden // 128,
      max_position_embeddings=4096, attn_implementation="sdpa")
  torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
  hf = transformers.LlamaForCausalLM(hf_cfg).eval().to(torch_dtype)
  ids = np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq))
  mask = np.ones_like(ids)
  with tempfile.TemporaryDirectory() as d:
    hf.save_pretrained(d)
    lm = models.from_pretrained(d, dtype=args.dtype)
  graphdef, params = nnx.split(lm)
  fwd = jax.jit(lambda params, ids, mask: nnx.merge(graphdef, params)(ids, mask))
  jids, jmask = jnp.asarray(ids), jnp.asarray(mask)
  fwd(params, jids, jmask).block_until_ready()
  t_jax = _median_time(lambda: fwd(params, jids, jmask).block_until_ready(), args.repeats)

  device = "cuda" if torch.cuda.is_available() else "cpu"
  hf = hf.to(device)
  tids, tmask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def torch_forward():
    hf(input_ids=tids, attention_mask=tmask)
    sync()

  with torch.no_grad():
    torch_forward()
    t_torch = _median_time(torch_forward, args.repeats)
    ref = hf(input_ids=tids, attention_mask=tmask).logits.float().cpu().numpy()
  diff = float(np.abs(np.asarray(fwd(params, jids, jmask), np.float32) - ref).max())
  n_params = sum(p.numel() for p in hf.parameters())
  print(f"forward  model={n_params / 1e6:.1f}M params  batch={args.batch}x{args.seq}  dtype={args.dtype}  "
        f"backend={jax.default_backend()}  torch={device}, {torch.get_num_threads()} threads")
  print(f"  jalign        {t_jax * 1e3:9.2f} ms")
  print(f"  transformers  {t_torch * 1e3:9.2f} ms")
  print(f"  ratio transformers/jalign = {t_torch / t_jax:.2f}x   (max |logit diff| {diff:.2e})")


def compile_times(args) -> None:
  from jalign import models

  print("compile (lower + XLA compile of the forward, seconds)")
  print(f"  {'layers':>6} {'scan on':>9} {'scan off':>9}")
  for layers in (2, 16):
    row = []
    for scan in (True, False):
      cfg = models.ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                               num_layers=layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128,
                               head_dim=64, scan_layers=scan)
      abstract = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
      graphdef, params = nnx.split(abstract)
      fwd = jax.jit(lambda params, ids: nnx.merge(graphdef, params)(ids))
      ids = jax.ShapeDtypeStruct((args.batch, args.seq), jnp.int32)
      t = time.perf_counter()
      fwd.lower(params, ids).compile()
      row.append(time.perf_counter() - t)
    print(f"  {layers:>6} {row[0]:9.2f} {row[1]:9.2f}")


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--repeats", type=int, default=10)
  p.add_argument("--skip-peer", action="store_true", help="only the compile-time table")
  args = p.parse_args()
  if not args.skip_peer:
    forward_vs_transformers(args)
  compile_times(args)


if __name__ == "__main__":
  main()
