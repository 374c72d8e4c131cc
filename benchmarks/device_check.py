"""One accelerator check in one short run: log-prob kernels, a ~1B-parameter SFT and GRPO step, and the sampler.

    python benchmarks/device_check.py --out device_check.json           # on the accelerator (a few minutes)
    python benchmarks/device_check.py --smoke --out /tmp/smoke.json     # tiny shapes on any backend (CI)

Sections (each timed on its own; a failing section is recorded with its error and the others still run):
- `logprobs`: value + gradient of `token_logprobs` at T=8192, D=2048, V=128256 in bf16 for `xla`, `chunked` and the
  chip's Pallas kernel: time, TFLOP/s (6 T D V useful FLOPs) and GB/s (inputs + gradients) against the chip's
  peaks, and each implementation's largest difference from `xla` on a small fp32 case (the first run of a kernel on
  new hardware is a correctness check too).
- `attention`: value + gradient of `kernels.attention` over one causal sequence of T=8192 tokens, 32 query heads over
  8 key/value heads of 128 (Llama-3-8B's attention) in bf16, for `xla`, `chunked` and the chip's own (`cudnn` on a
  GPU, `splash` on a TPU): time, TFLOP/s (6 T^2 N H useful FLOPs: a causal forward's 2 T^2 N H, the backward
  twice that), compiled temporaries, and each one's largest gradient difference from `xla` on a small packed bf16
  case (relative to the largest gradient).
- `sft_step`, `grpo_step`: one train step of a Llama-3.2-1B-shaped model (bf16 compute, fp32 weights and AdamW),
  8 rows of 2048 tokens, no remat: tokens/s, MFU (PaLM's 6N + 12 L H Dh T FLOPs per token) and XLA's memory analysis
  of the compiled step (32 GRPO rows needed 166 GiB on an H200).
- `decode`: `sampling.generate` tokens/s at batch 64 against the HBM-bandwidth bound (every decode step reads the
  bf16 weights and the KV cache once).
- `ragged_decode`: `kernels.decode_attention` for one decode step of 64 slots over a bf16 cache of 8192 positions
  (32 query heads over 8 key/value heads of 128), slot lengths drawn from a lognormal (mean 1024): the chip's Pallas
  kernel (each slot read to its own length) against the dense `xla` form (every slot to 8192), seconds, GB/s of the
  bytes the kernel must read, and their largest difference.
Only jax, flax and optax are needed (jalign is imported from the checkout). Figures go to `--out` as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jalign import kernels, models, sampling  # noqa: E402
from jalign.objectives import grpo, sft  # noqa: E402
from jalign.rl.batch import RolloutBatch  # noqa: E402
from jalign.train.metrics import flops_per_token, peak_flops, peak_hbm_bandwidth  # noqa: E402
from jalign.train.step import TrainState, make_step  # noqa: E402

FULL = dict(logprob_shape=(8192, 2048, 128256), check_shape=(512, 256, 32003), attention_shape=(8192, 32, 8, 128),
            attention_check=(300, 8, 2, 64), seq=2048, sft_rows=8, grpo_rows=8,
            grpo_prompt=256, decode_batch=64, decode_prompt=128, decode_new=256, repeats=5,
            model=dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, tie_embeddings=True, max_position_embeddings=4096))
FULL.update(ragged=(64, 32, 8, 8192, 128), ragged_mean=1024)
SMOKE = dict(logprob_shape=(64, 32, 1000), check_shape=(24, 16, 203), attention_shape=(128, 4, 2, 16),
             attention_check=(40, 4, 2, 16), seq=64, sft_rows=2, grpo_rows=4,
             grpo_prompt=16, decode_batch=4, decode_prompt=8, decode_new=8, repeats=2,
             model=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=16, tie_embeddings=True, max_position_embeddings=256))
SMOKE.update(ragged=(4, 4, 2, 256, 16), ragged_mean=64)


def best_time(fn, repeats: int) -> float:
  jax.block_until_ready(fn())  # compile + warm up
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def time_impls(out: dict, impls: dict, make_fn, args, *, shape, flops: float, repeats: int, peaks: dict,
               nbytes: float = 0.0) -> None:
  """Times each implementation that passed its correctness check (`out[impl]` has no error) on bf16 `args`:
  seconds, TFLOP/s and GB/s (of `nbytes` moved) with their fractions of the chip's peaks, compiled temporaries."""
  for impl, kw in impls.items():
    entry = out[impl]
    if "error" in entry:
      continue
    try:
      fn = make_fn(impl, kw)
      secs = best_time(lambda: fn(*args), repeats)
      entry.update(shape=list(shape), dtype="bfloat16", seconds=secs, tflops=flops / secs / 1e12,
                   temp_bytes=fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)
      if peaks["flops"]:
        entry["fraction_of_peak_flops"] = flops / secs / peaks["flops"]
      if nbytes:
        entry["gbytes_per_s"] = nbytes / secs / 1e9
        if peaks["hbm"]:
          entry["fraction_of_peak_hbm"] = nbytes / secs / peaks["hbm"]
    except Exception as e:  # noqa: BLE001 - recorded, the other implementations still run
      entry["error"] = _error(e)


def pallas_impl() -> tuple[str, bool]:
  """The chip's Pallas kernel, or the GPU one in interpret mode elsewhere (smoke: exercises the code path)."""
  backend = jax.default_backend()
  return ("pallas_tpu", False) if backend == "tpu" else ("pallas_gpu", backend != "gpu")


def logprobs_section(shapes: dict, peaks: dict) -> dict:
  out = {}
  pallas, interpret = pallas_impl()
  impls = {"xla": {}, "chunked": {}, pallas: dict(interpret=interpret)}

  def value_and_grad(impl, kw):
    return jax.jit(jax.value_and_grad(
        lambda h, w, y: jnp.sum(kernels.token_logprobs(h, w, y, impl=impl, **kw)[0]), argnums=(0, 1)))

  # Correctness on this chip: fp32, a ragged vocabulary, against xla.
  t, d, v = shapes["check_shape"]
  rng = np.random.RandomState(0)
  h, w = jnp.asarray(rng.randn(t, d), jnp.float32), jnp.asarray(rng.randn(d, v) * 0.05, jnp.float32)
  y = jnp.asarray(rng.randint(0, v, t))
  ref = value_and_grad("xla", {})(h, w, y)
  for impl, kw in impls.items():
    entry = out.setdefault(impl, {})
    try:
      got = value_and_grad(impl, kw)(h, w, y)
      entry["max_abs_diff_vs_xla"] = {"loss": float(jnp.abs(got[0] - ref[0])),
                                      "d_hidden": float(jnp.max(jnp.abs(got[1][0] - ref[1][0]))),
                                      "d_unembed": float(jnp.max(jnp.abs(got[1][1] - ref[1][1])))}
    except Exception as e:  # noqa: BLE001 - recorded, the other implementations still run
      entry["error"] = _error(e)

  t, d, v = shapes["logprob_shape"]
  h = jnp.asarray(rng.randn(t, d), jnp.bfloat16)
  w = jnp.asarray(rng.randn(d, v) * 0.02, jnp.bfloat16)
  y = jnp.asarray(rng.randint(0, v, t))
  flops, nbytes = 6.0 * t * d * v, 2 * 2 * (t * d + d * v)
  time_impls(out, impls, value_and_grad, (h, w, y), shape=(t, d, v), flops=flops, nbytes=nbytes,
             repeats=shapes["repeats"], peaks=peaks)
  return out


def attention_section(shapes: dict, peaks: dict) -> dict:
  backend = jax.default_backend()
  own = {"gpu": ("cudnn", {}), "tpu": ("splash", {})}.get(backend, ("splash", dict(interpret=True)))
  impls = {"xla": {}, "chunked": {}, own[0]: own[1]}
  out = {}

  def value_and_grad(impl, kw):
    def loss(q, k, v, seg):
      o = kernels.attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, impl=impl, **kw)
      return jnp.sum(o.astype(jnp.float32) ** 2)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def inputs(t, n, k, h, seg_fn):
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(1, t, n, h), jnp.bfloat16)
    kv = [jnp.asarray(rng.randn(1, t, k, h), jnp.bfloat16) for _ in range(2)]
    return q, *kv, jnp.asarray(seg_fn(t))[None]

  # Correctness on this chip: bf16, left padding then two packed sequences, against xla (valid rows only).
  def packed(t):
    return np.concatenate([np.zeros(t // 10), np.ones(t // 2 - t // 10), np.full(t - t // 2, 2)]).astype(np.int32)

  args = inputs(*shapes["attention_check"], packed)
  valid = (args[3] != 0)[..., None, None]
  ref = value_and_grad("xla", {})(*args)
  for impl, kw in impls.items():
    entry = out.setdefault(impl, {})
    try:
      got = value_and_grad(impl, kw)(*args)
      diff = lambda a, b: jnp.max(jnp.abs(jnp.where(valid, (a - b).astype(jnp.float32), 0)))  # noqa: E731
      entry["max_rel_diff_vs_xla"] = {f"d_{name}": float(diff(a, b) / jnp.max(jnp.abs(b.astype(jnp.float32))))
                                      for name, a, b in zip("qkv", got[1], ref[1])}
    except Exception as e:  # noqa: BLE001 - recorded, the other implementations still run
      entry["error"] = _error(e)

  t, n, k, h = shapes["attention_shape"]
  args = inputs(t, n, k, h, lambda t: np.ones(t, np.int32))
  flops = 6.0 * t * t * n * h
  time_impls(out, impls, value_and_grad, args, shape=(t, n, k, h), flops=flops, repeats=shapes["repeats"],
             peaks=peaks)
  return out


def _model(shapes, param_dtype="float32"):
  cfg = models.ModelConfig(**shapes["model"], dtype="bfloat16", param_dtype=param_dtype)
  return cfg, models.create(cfg, seed=0)


def _train_step(cfg, lm, loss_fn, batch, repeats, seq_len, peaks) -> dict:
  graphdef, params = nnx.split(lm)
  params = nnx.to_pure_dict(params)
  optimizer = optax.adamw(1e-5)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((), jnp.int32))
  step = jax.jit(make_step(loss_fn(graphdef), optimizer, lambda s: 1e-5, 1), donate_argnums=0)
  holder = {"state": state}
  memory = step.lower(state, batch).compile().memory_analysis()  # XLA's figures for the compiled step on this chip

  def run():
    holder["state"], metrics = step(holder["state"], batch)
    return metrics

  secs = best_time(run, repeats)
  tokens = int(jax.tree.leaves(batch)[0].shape[0]) * seq_len  # rows x sequence length
  out = {"params": cfg.num_params(), "tokens_per_step": tokens, "seconds": secs, "tokens_per_s": tokens / secs}
  if memory is not None:
    out["memory_gib"] = {k: getattr(memory, f"{k}_size_in_bytes") / 2**30
                         for k in ("argument", "output", "temp", "alias", "generated_code")}
  if peaks["flops"]:
    out["mfu"] = tokens / secs * flops_per_token(cfg, seq_len) / peaks["flops"]
  return out


def sft_section(shapes, peaks) -> dict:
  cfg, lm = _model(shapes)
  rows, seq = shapes["sft_rows"], shapes["seq"]
  rng = np.random.RandomState(1)
  batch = {"tokens": jnp.asarray(rng.randint(0, cfg.vocab_size, (rows, seq)), jnp.int32),
           "segment_ids": jnp.ones((rows, seq), jnp.int32),
           "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
           "loss_mask": jnp.ones((rows, seq), jnp.int32)}
  return _train_step(cfg, lm, lambda g: sft.make_loss_fn(g), batch, shapes["repeats"], seq, peaks)


def grpo_section(shapes, peaks) -> dict:
  cfg, lm = _model(shapes)
  rows, seq, p = shapes["grpo_rows"], shapes["seq"], shapes["grpo_prompt"]
  r = seq - p
  rng = np.random.RandomState(2)
  tokens = rng.randint(0, cfg.vocab_size, (rows, seq))
  batch = RolloutBatch(tokens=jnp.asarray(tokens, jnp.int32), segment_ids=jnp.ones((rows, seq), jnp.int32),
                       positions=jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
                       response=jnp.asarray(tokens[:, p:], jnp.int32), response_mask=jnp.ones((rows, r), jnp.int32),
                       advantages=jnp.asarray(rng.randn(rows, r), jnp.float32),
                       ref_logp=jnp.asarray(-rng.rand(rows, r) * 5, jnp.float32))
  loss = lambda g: grpo.make_loss_fn(g, grpo.GrpoLossConfig(global_rows=rows))  # noqa: E731
  return _train_step(cfg, lm, loss, batch, shapes["repeats"], seq, peaks)


def decode_section(shapes, peaks) -> dict:
  cfg, lm = _model(shapes, param_dtype="bfloat16")
  b, p, new = shapes["decode_batch"], shapes["decode_prompt"], shapes["decode_new"]
  rng = np.random.RandomState(3)
  ids = rng.randint(0, cfg.vocab_size, (b, p))
  mask = np.ones((b, p), np.int32)

  def run():
    return sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=new, temperature=1.0,
                             cache_dtype=jnp.bfloat16).tokens

  secs = best_time(run, max(1, shapes["repeats"] // 2))
  out = {"batch": b, "prompt": p, "new_tokens": new, "seconds": secs, "tokens_per_s": b * new / secs}
  # Each decode step reads every weight once (bf16) and the KV cache filled so far (on average half-way).
  weight_bytes = cfg.num_params() * 2
  kv_bytes = b * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * (sampling.prompt_bucket(p) + new / 2) * 2
  out["bytes_per_decode_step"] = weight_bytes + kv_bytes
  if peaks["hbm"]:
    bound = b * peaks["hbm"] / (weight_bytes + kv_bytes)
    out.update(bound_tokens_per_s=bound, fraction_of_bound=out["tokens_per_s"] / bound)
  return out


def ragged_decode_section(shapes, peaks) -> dict:
  b, n, k, s, h = shapes["ragged"]
  rng = np.random.RandomState(4)
  mean = shapes["ragged_mean"]
  lengths = np.clip(np.round(rng.lognormal(np.log(mean) - 0.5, 1.0, b)), 1, s).astype(np.int32)
  q = jnp.asarray(rng.randn(b, n, h), jnp.bfloat16)
  cache = [jnp.asarray(rng.randn(b, k, s, h), jnp.bfloat16) for _ in range(2)]
  pallas, interpret = pallas_impl()
  out = {"shape": [b, n, k, s, h], "lengths_mean": float(lengths.mean()), "lengths_max": int(lengths.max())}
  fns = {impl: jax.jit(lambda q, kc, vc, n_, impl=impl, kw=kw: kernels.decode_attention(
      q, kc, vc, n_, scale=h ** -0.5, impl=impl, **kw)) for impl, kw in (("xla", {}), (pallas, dict(
          interpret=interpret)))}
  args = (q, *cache, jnp.asarray(lengths))
  results = {}
  for impl, fn in fns.items():
    entry = out.setdefault(impl, {})
    try:
      results[impl] = np.asarray(fn(*args), np.float32)
      entry["seconds"] = best_time(lambda: fn(*args), shapes["repeats"])
      needed = 2 * int(lengths.sum()) * k * h * 2  # keys and values up to each slot's length, bf16
      entry["gbytes_per_s_of_needed"] = needed / entry["seconds"] / 1e9
      if peaks["hbm"]:
        entry["fraction_of_peak_hbm"] = needed / entry["seconds"] / peaks["hbm"]
    except Exception as e:  # noqa: BLE001 - recorded, the other implementation still runs
      entry["error"] = _error(e)
  if len(results) == 2:
    out["max_abs_diff"] = float(np.abs(results["xla"] - results[pallas]).max())
    out["xla_over_kernel_seconds"] = out["xla"]["seconds"] / out[pallas]["seconds"]
  return out


def _error(e: Exception) -> str:
  return f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exception(e)[-4:])[-2000:]


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (any backend; for CI)")
  ap.add_argument("--out", default="device_check.json")
  ap.add_argument("--only", nargs="*", default=(), help="run only these sections")
  args = ap.parse_args()
  shapes = SMOKE if args.smoke else FULL
  device = jax.devices()[0]
  peaks = {"flops": peak_flops(0.0), "hbm": peak_hbm_bandwidth()}
  report = {"backend": jax.default_backend(), "device_kind": device.device_kind, "devices": jax.device_count(),
            "jax": jax.__version__, "smoke": args.smoke, "peak_flops": peaks["flops"], "peak_hbm_bytes_per_s":
            peaks["hbm"], "sections": {}}
  sections = {"logprobs": logprobs_section, "attention": attention_section, "sft_step": sft_section,
              "grpo_step": grpo_section,
              "decode": decode_section, "ragged_decode": ragged_decode_section}
  failed = False
  for name, fn in sections.items():
    if args.only and name not in args.only:
      continue
    start = time.perf_counter()
    try:
      report["sections"][name] = fn(shapes, peaks)
    except Exception as e:  # noqa: BLE001 - the other sections still run
      report["sections"][name] = {"error": _error(e)}
    report["sections"][name]["wall_s"] = time.perf_counter() - start
    failed |= "error" in json.dumps(report["sections"][name])
    print(f"{name}: {json.dumps(report['sections'][name], indent=1)}", flush=True)
    with open(args.out + ".tmp", "w", encoding="utf-8") as f:  # complete after every section, replaced atomically
      json.dump(report, f, indent=1)
    os.replace(args.out + ".tmp", args.out)
  print(f"wrote {args.out}")
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
