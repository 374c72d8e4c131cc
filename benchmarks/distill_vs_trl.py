"""On-policy distillation throughput (the student samples, then learns the teacher's distribution at every sampled
token): jalign vs TRL's DistillationTrainer on CPU.

    python benchmarks/distill_vs_trl.py [--steps 8] [--model DIR|FILE.gguf] [--teacher DIR]

Student: the tiny random Llama (hidden 256, 4 layers, vocab 4096) or --model (benchmarks/checkpoints.py); teacher:
--teacher, or by default a wider random Llama with the student's tokenizer (hidden 512, 8 heads, 4 layers). Both fp32,
on both sides: 8 prompts a step, one completion each of up to 64 new tokens at temperature 1, the reverse KL over the
whole vocabulary at every completion token (TRL's beta=1, its default; jalign's `distill.mode=gkd` with `lmbda=1`:
every batch on the student's own samples), AdamW at lr 1e-4, one update per step. Reported: tokens (prompt +
completion) per second of whole steps (sampling, teacher and student forwards, update), the median step after one
warm-up step, and the ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import Checkpoint, add_model_flag, prepare

PROMPTS, NEW_TOKENS = 8, 64


def write_prompts(ckpt: Checkpoint) -> None:
  """Prompts of 16-31 words; jalign's SFT layout needs a completion, which GKD at lmbda 1 replaces every step."""
  with open(os.path.join(ckpt.workdir, "prompts.jsonl"), "w") as f:
    for i in range(256):
      f.write(json.dumps({"prompt": ckpt.text(16 + i % 16, i), "completion": ckpt.text(1, 10_000 + i)}) + "\n")


def wider_teacher(ckpt: Checkpoint) -> str:
  import torch
  import transformers
  path = os.path.join(ckpt.workdir, "teacher")
  config = transformers.AutoConfig.from_pretrained(ckpt.path)
  config.update(dict(hidden_size=2 * config.hidden_size, num_attention_heads=2 * config.num_attention_heads,
                     num_key_value_heads=2 * config.num_key_value_heads,
                     intermediate_size=2 * config.intermediate_size))
  torch.manual_seed(1)
  transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
  for name in os.listdir(ckpt.path):
    if name.startswith(("tokenizer", "special_tokens")):
      shutil.copy(os.path.join(ckpt.path, name), path)
  return path


def trl_rates(ckpt: Checkpoint, teacher: str, steps: int) -> list[float]:
  import datasets
  import transformers
  from trl import DistillationConfig, DistillationTrainer

  times, tokens = [], []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.t)

  rows = [json.loads(line) for line in open(os.path.join(ckpt.workdir, "prompts.jsonl"))]
  tok = transformers.AutoTokenizer.from_pretrained(ckpt.path)
  tok.pad_token = tok.pad_token or tok.eos_token
  as_chat = lambda p: [{"role": "user", "content": p}] if tok.chat_template else p  # noqa: E731
  ds = datasets.Dataset.from_list([{"prompt": as_chat(r["prompt"])} for r in rows])
  model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype="float32")
  teacher_model = transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype="float32")
  # TRL's configs default to bf16=True, which on CPU autocasts the matmuls to bf16: both sides fp32.
  with tempfile.TemporaryDirectory() as out:
    args = DistillationConfig(output_dir=out, per_device_train_batch_size=PROMPTS, max_completion_length=NEW_TOKENS,
                              temperature=1.0, beta=1.0, learning_rate=1e-4, lr_scheduler_type="constant",
                              max_steps=steps, logging_steps=10_000, save_strategy="no", report_to=[], use_cpu=True,
                              use_vllm=False, dataloader_num_workers=0, seed=0, bf16=False, max_grad_norm=0.0,
                              gradient_checkpointing=False)
    trainer = DistillationTrainer(model=model, teacher_model=teacher_model, args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[Timer()])
    real = trainer.compute_loss

    def counting_loss(model, inputs, *a, **k):
      tokens.append(int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()))
      return real(model, inputs, *a, **k)

    trainer.compute_loss = counting_loss
    trainer.train()
  return [n / t for n, t in zip(tokens, times)]


def jalign_rates(ckpt: Checkpoint, teacher: str, steps: int) -> list[float]:
  run_dir = tempfile.mkdtemp()
  root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
  cmd = [sys.executable, "-m", "jalign.run", "--config=configs/distill.py:gkd", f"--config.model.path={ckpt.path}",
         f"--config.distill.teacher={teacher}", "--config.distill.lmbda=1.0", "--config.distill.beta=1.0",
         f"--config.data.train={ckpt.workdir}/prompts.jsonl", "--config.data.eval=", "--config.data.max_length=128",
         "--config.data.buckets=(128,)", f"--config.train.batch_size={PROMPTS}", "--config.train.seq_len=128",
         f"--config.sampling.max_new_tokens={NEW_TOKENS}", "--config.sampling.temperature=1.0",
         "--config.optim.lr=1e-4", "--config.optim.schedule=constant", "--config.optim.warmup_steps=0",
         "--config.optim.clip_norm=0", f"--config.train.steps={steps}", "--config.train.log_every=1",
         "--config.train.eval_every=0", "--config.train.eval_examples=0", f"--config.run_dir={run_dir}",
         "--config.checkpoint.every=0", "--config.checkpoint.export_hf=False", "--config.log.progress=False",
         "--config.log.tensorboard=False", "--config.model.dtype=float32"]
  subprocess.run(cmd, check=True, cwd=root)
  return [r["perf/tokens_per_s"] for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
          if "perf/tokens_per_s" in r]


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--teacher", default="", help="an HF directory sharing the student's tokenizer (default: a wider "
                 "random Llama)")
  add_model_flag(p)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as path:
    ckpt = prepare(args.model, path)
    write_prompts(ckpt)
    teacher = args.teacher or wider_teacher(ckpt)
    print(f"student: {ckpt.description}; teacher: {args.teacher or 'random Llama, twice as wide'}; fp32")
    j = jalign_rates(ckpt, teacher, args.steps)[1:]
    t = trl_rates(ckpt, teacher, args.steps)[1:]
  jm, tm = statistics.median(j), statistics.median(t)
  print(f"on-policy distillation, {PROMPTS} prompts x <= {NEW_TOKENS} new tokens, reverse KL over the vocabulary, CPU:")
  print(f"  jalign  {jm:8.0f} tokens/s  (steps after the first: {[round(x) for x in j]})")
  print(f"  TRL     {tm:8.0f} tokens/s  (steps after the first: {[round(x) for x in t]})")
  print(f"  ratio jalign/TRL = {jm / tm:.2f}x")


if __name__ == "__main__":
  main()
