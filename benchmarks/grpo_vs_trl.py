"""Seconds per GRPO step (generation + update): jalign vs TRL's GRPOTrainer (its own generate path) on CPU.

    python benchmarks/grpo_vs_trl.py [--steps 8] [--model DIR|FILE.gguf]

Same HF model on both sides (the tiny random Llama: hidden 256, 4 layers, vocab 4096; or --model, see
benchmarks/checkpoints.py; a model with a chat template gets its prompts templated on both sides), fp32, 8 prompts x
8 generations x up to 64 new tokens at temperature 1, one optimizer update per step, KL coefficient 0.001 to a frozen
reference, a constant-zero reward on both sides (random words as prompts get no verifiable answers; the update still
runs in full). Reported: median seconds per step after one warm-up step (steady state: a step that meets a new
prompt-length bucket compiles, and the median leaves such steps out), and jalign's split into generation and update.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from checkpoints import Checkpoint, add_model_flag, prepare

PROMPTS, GENERATIONS, NEW_TOKENS = 8, 8, 64


def write_prompts(ckpt: Checkpoint) -> None:
  with open(os.path.join(ckpt.workdir, "prompts.jsonl"), "w") as f:
    for i in range(64):
      f.write(json.dumps({"prompt": ckpt.text(16 + i % 16, i), "answer": "0"}) + "\n")


def trl_seconds(ckpt: Checkpoint, steps: int) -> list[float]:
  import datasets
  import transformers
  from trl import GRPOConfig, GRPOTrainer

  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.t)

  def reward(completions, **kw):
    return [0.0 for _ in completions]

  rows = [json.loads(l) for l in open(os.path.join(ckpt.workdir, "prompts.jsonl"))]
  model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype="float32")
  tok = transformers.AutoTokenizer.from_pretrained(ckpt.path)
  tok.pad_token = tok.pad_token or tok.eos_token
  # jalign renders a string prompt as one user turn with the chat template when the tokenizer has one; TRL does so
  # for conversational prompts
  as_chat = lambda p: [{"role": "user", "content": p}] if tok.chat_template else p
  ds = datasets.Dataset.from_list([{"prompt": as_chat(r["prompt"])} for r in rows])
  # TRL's configs default to bf16=True, which on CPU autocasts the matmuls to bf16 (7x slower on an AVX2-only CPU,
  # and not the fp32 arithmetic jalign runs): both sides fp32.
  with tempfile.TemporaryDirectory() as out:
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GENERATIONS,
                      num_generations=GENERATIONS, max_completion_length=NEW_TOKENS, temperature=1.0, beta=0.001,
                      learning_rate=1e-4, max_steps=steps, logging_steps=10_000, save_strategy="no", report_to=[],
                      use_cpu=True, use_vllm=False, dataloader_num_workers=0, seed=0, num_iterations=1,
                      bf16=False)
    GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                callbacks=[Timer()]).train()
  return times


def jalign_seconds(ckpt: Checkpoint, steps: int) -> list[dict]:
  run_dir = tempfile.mkdtemp()
  cmd = [sys.executable, "-m", "jalign.run", f"--config={os.path.dirname(__file__)}/../configs/grpo.py",
         f"--config.model.path={ckpt.path}", f"--config.grpo.prompts={ckpt.workdir}/prompts.jsonl",
         "--config.grpo.eval_prompts=",
         f"--config.grpo.prompts_per_step={PROMPTS}", f"--config.sampling.num_samples={GENERATIONS}",
         f"--config.sampling.max_new_tokens={NEW_TOKENS}", "--config.sampling.max_prompt_length=64",
         "--config.grpo.mini_batches=1", "--config.grpo.dynamic_sampling=False", "--config.grpo.compact_sizes=0",
         "--config.kl.coef=0.001",  # TRL's beta: the reference forward on both sides
         "--config.reward.weights=(('format',1.0),)",
         # TRL's learning rate; the demo's warmup and cosine decay would not fit a few steps
         "--config.optim.lr=1e-4", "--config.optim.schedule=constant", "--config.optim.warmup_steps=0",
         f"--config.train.steps={steps}", "--config.train.log_every=1", f"--config.run_dir={run_dir}",
         "--config.checkpoint.every=0", "--config.checkpoint.export_hf=False", "--config.log.progress=False",
         "--config.log.tensorboard=False", "--config.model.dtype=float32", "--config.grpo.no_signal=update"]
  subprocess.run(cmd, check=True, cwd=os.path.join(os.path.dirname(__file__), ".."))
  return [json.loads(l) for l in open(os.path.join(run_dir, "metrics.jsonl")) if "timing_s/gen" in l]


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=8)
  add_model_flag(p)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as path:
    ckpt = prepare(args.model, path)
    write_prompts(ckpt)
    print(f"model: {ckpt.description}, fp32")
    rows = jalign_seconds(ckpt, args.steps)[1:]
    j_total = statistics.median(r["timing_s/step"] for r in rows)
    j_gen = statistics.median(r["timing_s/gen"] for r in rows)
    j_update = statistics.median(r["timing_s/update"] for r in rows)
    t = trl_seconds(ckpt, args.steps)[1:]
    t_total = statistics.median(t)
  print(f"GRPO step, {PROMPTS} prompts x {GENERATIONS} generations x <= {NEW_TOKENS} new tokens, CPU:")
  print(f"  jalign        {j_total:6.2f} s/step  (generation {j_gen:.2f} s, update {j_update:.2f} s, between them "
        f"{j_total - j_gen - j_update:.2f} s: batch, reference log-probs, advantages)")
  print(f"  TRL           {t_total:6.2f} s/step")
  print(f"  each step after the first: jalign {[round(r['timing_s/step'], 2) for r in rows]} (a step that meets a new "
        f"prompt-length bucket compiles), TRL {[round(x, 2) for x in t]}")
  print(f"  ratio TRL/jalign = {t_total / j_total:.2f}x")


if __name__ == "__main__":
  main()
