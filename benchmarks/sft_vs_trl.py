"""SFT training throughput: jalign vs TRL's SFTTrainer, and jalign's step vs a minimal hand-written JAX step.

    python benchmarks/sft_vs_trl.py [--steps 12] [--cases a,b,c] [--scan-layers] [--model DIR|FILE.gguf]

Same HF model on both sides (the tiny random Llama: hidden 256, 4 layers, vocab 4096; or --model, see
benchmarks/checkpoints.py), fp32, same AdamW (lr 1e-4, betas 0.9/0.999, eps 1e-8,
weight decay 0, no clipping) on CPU, torch using all cores:
  (a) fixed-length batches of 8 x 256 tokens, loss on every token, no padding on either side;
  (b) variable-length sequences (16-512 tokens): TRL with its defaults (no packing: batches of 8 padded to the
      longest) vs jalign packing into rows of 512 (4 rows per step); throughput counts real tokens only;
  (c) jalign's train step vs a minimal JAX step (plain jnp Llama forward, optax AdamW, one jit) on case (a).
Prints tokens/s and the ratios. Timing skips the first steps (compilation, warm-up) and takes the median.
jalign runs the 4 layers unrolled (`scan_layers=False`, as TRL's eager loop and the minimal step do): on XLA's CPU
backend the scanned stack fills and reads stacked per-layer buffers. `--scan-layers` also times case (a) scanned
(the configs' default), for the record. Case (c)'s minimal step is written for the tiny Llama only.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from checkpoints import TINY, Checkpoint, add_model_flag, prepare

HIDDEN, LAYERS, HEADS = TINY["hidden_size"], TINY["num_hidden_layers"], TINY["num_attention_heads"]
LR = 1e-4


def fixed_records(ckpt: Checkpoint, n: int, seq: int, seed: int = 0) -> list[list[int]]:
  return [ckpt.ids(seq, seed * 100_003 + i) for i in range(n)]


def variable_records(ckpt: Checkpoint, n: int, seed: int = 1) -> list[list[int]]:
  lengths = np.random.RandomState(seed).randint(16, 513, n)
  return [ckpt.ids(int(k), seed * 100_003 + i) for i, k in enumerate(lengths)]


# ---------------------------------------------------------------------------------------------------------------- TRL

def trl_tokens_per_s(path: str, records, batch_size: int, max_length: int, steps: int, warmup: int) -> float:
  import datasets
  import torch
  import transformers
  from trl import SFTConfig, SFTTrainer

  times, tokens = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.t)

  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(path)
  ds = datasets.Dataset.from_dict({"input_ids": records})
  # TRL's configs default to bf16=True, which on CPU autocasts the matmuls to bf16 (7x slower on an AVX2-only CPU,
  # and not the fp32 arithmetic jalign runs): both sides fp32.
  with tempfile.TemporaryDirectory() as out:
    args = SFTConfig(output_dir=out, per_device_train_batch_size=batch_size, max_steps=steps, learning_rate=LR,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", max_length=max_length,
                     logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
                     dataloader_num_workers=0, dataset_num_proc=None, seed=0, bf16=False)
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok, callbacks=[Timer()])

    real = trainer.compute_loss

    def counting_loss(model, inputs, *a, **k):
      tokens.append(int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else inputs["input_ids"].numel())
      return real(model, inputs, *a, **k)

    trainer.compute_loss = counting_loss
    trainer.train()
  per_step = np.asarray(times[warmup:])
  return float(np.sum(tokens[warmup:len(times)]) / np.sum(per_step)), torch.get_num_threads()


# ------------------------------------------------------------------------------------------------------------- jalign

def jalign_step(path: str, scan_layers: bool = False):
  """jalign's SFT step (objective + accumulation scan + AdamW) on one device, as the loop builds it."""
  from flax import nnx

  from jalign import models
  from jalign.objectives import sft
  from jalign.train.step import TrainState, make_step

  lm = models.from_pretrained(path, dtype="float32", scan_layers=scan_layers)
  graphdef, params = nnx.split(lm)
  params = nnx.to_pure_dict(params)
  opt = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
  state = TrainState(jnp.zeros((), jnp.int32), params, opt.init(params), jnp.zeros((), jnp.int32))
  step = jax.jit(make_step(sft.make_loss_fn(graphdef), opt, lambda s: LR, 1), donate_argnums=0)
  return state, step


def time_steps(step, state, batches, warmup: int) -> tuple[float, object]:
  times, tokens = [], []
  for i, batch in enumerate(batches):
    t = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    if i >= warmup:
      times.append(time.perf_counter() - t)
      tokens.append(int(np.sum(np.asarray(batch["segment_ids"]) != 0)))
  return float(np.sum(tokens) / np.sum(times)), state


def fixed_batches(records, batch_size: int):
  for i in range(0, len(records) - batch_size + 1, batch_size):
    tokens = np.asarray(records[i:i + batch_size], np.int32)
    ones = np.ones_like(tokens)
    yield {"tokens": tokens, "loss_mask": ones, "segment_ids": ones,
           "positions": np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape).copy()}


def packed_batches(records, rows: int, seq_len: int, steps: int):
  from jalign.data import pipeline
  from jalign.data.sources import ListSource

  def encode(r):
    ids = np.asarray(r["ids"], np.int32)
    return {"tokens": ids, "loss_mask": np.ones_like(ids)}

  ds, _ = pipeline.build(ListSource([{"ids": r} for r in records]), encode,
                         pipeline.PipelineSpec(batch_size=rows, seq_len=seq_len, shuffle=False))
  it = iter(ds)
  for _ in range(steps):
    yield next(it)


# --------------------------------------------------------------------------------------------- minimal JAX reference

def minimal_step(path: str):
  """The leanest reasonable JAX SFT step: plain-jnp Llama, unrolled layers, optax AdamW, one jit."""
  from safetensors.numpy import load_file
  w = {k: jnp.asarray(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
  hd = HIDDEN // HEADS
  inv = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))

  def rms(x, g):
    return g * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6))

  def rope(x, pos):
    ang = pos[..., None] * inv
    full = jnp.concatenate([ang, ang], -1)
    cos, sin = jnp.cos(full)[:, :, None], jnp.sin(full)[:, :, None]
    x1, x2 = jnp.split(x, 2, -1)
    return x * cos + jnp.concatenate([-x2, x1], -1) * sin

  def loss(p, tokens):
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.float32), (b, t))
    x = p["model.embed_tokens.weight"][tokens]
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(LAYERS):
      g = lambda n: p[f"model.layers.{i}.{n}"]
      h = rms(x, g("input_layernorm.weight"))
      q = rope((h @ g("self_attn.q_proj.weight").T).reshape(b, t, HEADS, hd), pos)
      k = rope((h @ g("self_attn.k_proj.weight").T).reshape(b, t, HEADS, hd), pos)
      v = (h @ g("self_attn.v_proj.weight").T).reshape(b, t, HEADS, hd)
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
      a = jax.nn.softmax(jnp.where(causal, s, -1e30), -1)
      x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, HIDDEN) @ g("self_attn.o_proj.weight").T
      h = rms(x, g("post_attention_layernorm.weight"))
      x = x + (jax.nn.silu(h @ g("mlp.gate_proj.weight").T) * (h @ g("mlp.up_proj.weight").T)) @ g(
          "mlp.down_proj.weight").T
    logits = rms(x, p["model.norm.weight"]) @ p["lm_head.weight"].T
    logp = jax.nn.log_softmax(logits[:, :-1], -1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  opt = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)

  @jax.jit
  def step(state, batch):
    params, opt_state = state
    l, grads = jax.value_and_grad(loss)(params, batch["tokens"])
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), l

  return (w, opt.init(w)), step


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--cases", default="a,b,c")
  p.add_argument("--scan-layers", action="store_true",
                 help="also time case (a) with jalign's layers scanned (the configs' default)")
  add_model_flag(p)
  args = p.parse_args()
  cases = set(args.cases.split(","))
  n = args.steps + 1
  with tempfile.TemporaryDirectory() as path:
    ckpt = prepare(args.model, path)
    path = ckpt.path
    if "c" in cases and not ckpt.tiny:
      raise SystemExit("case (c)'s minimal step is written for the tiny Llama: --cases a,b with --model")
    print(f"model: {ckpt.description}, fp32; backend {jax.default_backend()}")
    if "a" in cases or "c" in cases:
      records = fixed_records(ckpt, 8 * n, 256)
      state, step = jalign_step(path)
      ja, _ = time_steps(step, state, fixed_batches(records, 8), args.warmup)
    if "a" in cases:
      tr, threads = trl_tokens_per_s(path, records, 8, 256, args.steps, args.warmup)
      print(f"(a) fixed 8x256:     jalign {ja:8.0f} tok/s   TRL {tr:8.0f} tok/s (torch {threads} threads)"
            f"   jalign/TRL = {ja / tr:.2f}x")
      if args.scan_layers:
        state, step = jalign_step(path, scan_layers=True)
        js, _ = time_steps(step, state, fixed_batches(records, 8), args.warmup)
        print(f"    layers scanned:  jalign {js:8.0f} tok/s   jalign/TRL = {js / tr:.2f}x")
    if "b" in cases:
      records = variable_records(ckpt, 8 * n)
      state, step = jalign_step(path)
      jb, _ = time_steps(step, state, packed_batches(variable_records(ckpt, 400), 4, 512, n), args.warmup)
      tb, _ = trl_tokens_per_s(path, records, 8, 512, args.steps, args.warmup)
      print(f"(b) variable 16-512: jalign {jb:8.0f} tok/s   TRL {tb:8.0f} tok/s   jalign/TRL = {jb / tb:.2f}x"
            "   (real tokens only; jalign packs 4x512 rows, TRL pads batches of 8)")
    if "c" in cases:
      state, step = minimal_step(path)
      batches = fixed_batches(fixed_records(ckpt, 8 * n, 256), 8)
      jm, _ = time_steps(lambda s, b: step(s, b), state, batches, args.warmup)
      print(f"(c) step overhead:   jalign {ja:8.0f} tok/s   minimal JAX {jm:8.0f} tok/s   "
            f"overhead = {(jm / ja - 1) * 100:+.1f}%")


if __name__ == "__main__":
  main()
