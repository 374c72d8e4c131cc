"""DPO training throughput: jalign vs TRL's DPOTrainer on CPU, with a reference forward per step and with
precomputed reference log-probs on both sides.

    python benchmarks/dpo_vs_trl.py [--steps 12] [--scan-layers] [--whole-sequences] [--reference both]
                                    [--model DIR|FILE.gguf]

Same HF model on both sides (the tiny random Llama: hidden 256, 4 layers, vocab 4096; or --model, see
benchmarks/checkpoints.py), fp32, 8 pairs per step of 128 prompt + 128
completion tokens (chosen and rejected: 8 x 2 x 256 real tokens), sigmoid loss, beta 0.1, AdamW lr 1e-4, constant
schedule, clipping at 1.0 on both sides. Reported: real tokens/s, median after 3 warm-up steps.

jalign runs the 4 layers unrolled (`model.scan_layers=False`, as TRL's eager loop does): on XLA's CPU backend the
scanned stack fills and reads stacked per-layer buffers (5-10% of a step on average, benchmarks/README.md).
`--scan-layers` also times the scanned default, for the record. jalign runs each pair's prompt once under both
completions (`dpo.share_prompt`, its default: 128 + 2 x 128 positions per pair through the model instead of 2 x 256,
the same loss); `--whole-sequences` also times it on the two whole sequences per pair, as TRL runs them.
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from checkpoints import Checkpoint, add_model_flag, prepare

PAIRS, PROMPT, COMPLETION = 8, 128, 128
TOKENS_PER_STEP = PAIRS * 2 * (PROMPT + COMPLETION)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def write_pairs(ckpt: Checkpoint) -> None:
  with open(os.path.join(ckpt.workdir, "pairs.jsonl"), "w") as f:
    for i in range(64):  # plain style: the completion gets eos appended on both sides
      f.write(json.dumps({"prompt": ckpt.text(PROMPT, i), "chosen": ckpt.text(COMPLETION - 1, i + 1000),
                          "rejected": ckpt.text(COMPLETION - 1, i + 2000)}) + "\n")


def trl_tokens_per_s(ckpt: Checkpoint, steps: int, precompute: bool) -> float:
  import datasets
  import transformers
  from trl import DPOConfig, DPOTrainer

  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
      times.append(time.perf_counter() - self.t)

  path = ckpt.path
  ds = datasets.Dataset.from_list([json.loads(line) for line in open(os.path.join(ckpt.workdir, "pairs.jsonl"))])
  model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
  ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
  tok = transformers.AutoTokenizer.from_pretrained(path)
  tok.pad_token = tok.pad_token or tok.eos_token
  # TRL's configs default to bf16=True, which on CPU autocasts the matmuls to bf16 (7x slower on an AVX2-only CPU,
  # and not the fp32 arithmetic jalign runs): both sides fp32.
  with tempfile.TemporaryDirectory() as out:
    args = DPOConfig(output_dir=out, per_device_train_batch_size=PAIRS, max_steps=steps, learning_rate=1e-4,
                     lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.1,
                     optim="adamw_torch", max_length=PROMPT + COMPLETION, logging_steps=10_000, save_strategy="no",
                     report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
                     precompute_ref_log_probs=precompute, bf16=False)
    DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tok,
               callbacks=[Timer()]).train()
  return TOKENS_PER_STEP / statistics.median(times[3:])


def jalign_tokens_per_s(ckpt: Checkpoint, steps: int, precompute: bool, scan_layers: bool = False,
                        share_prompt: bool = True) -> float:
  run_dir = tempfile.mkdtemp()
  cmd = [sys.executable, "-m", "jalign.run", f"--config={ROOT}/configs/dpo.py", f"--config.model.path={ckpt.path}",
         "--config.tokenizer=", f"--config.data.train={ckpt.workdir}/pairs.jsonl", "--config.data.eval=",
         "--config.dpo.eval_prompts=", "--config.dpo.rpo_alpha=0.0", f"--config.dpo.precompute_ref_logps={precompute}",
         f"--config.data.max_length={PROMPT + COMPLETION}", f"--config.train.seq_len={PROMPT + COMPLETION}",
         f"--config.train.batch_size={PAIRS}", f"--config.train.steps={steps}", "--config.train.log_every=1",
         "--config.optim.lr=1e-4", "--config.optim.schedule=constant", "--config.optim.warmup_steps=0",
         "--config.optim.clip_norm=1.0", f"--config.run_dir={run_dir}", "--config.checkpoint.every=0",
         "--config.checkpoint.export_hf=False", "--config.log.progress=False", "--config.log.tensorboard=False",
         f"--config.model.scan_layers={scan_layers}", f"--config.dpo.share_prompt={share_prompt}",
         "--config.model.dtype=float32", "--config.data.pair_checks=off"]
  subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  times = [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r]
  return TOKENS_PER_STEP / statistics.median(times[3:])


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--scan-layers", action="store_true",
                 help="also time jalign with its layers scanned (the configs' default)")
  p.add_argument("--whole-sequences", action="store_true",
                 help="also time jalign on two whole sequences per pair (dpo.share_prompt=False), as TRL")
  p.add_argument("--reference", choices=("both", "forward", "precomputed"), default="both",
                 help="the reference log-probs: a forward per step, precomputed, or both cases")
  add_model_flag(p)
  args = p.parse_args()
  rows = []
  with tempfile.TemporaryDirectory() as path:
    ckpt = prepare(args.model, path)
    write_pairs(ckpt)
    print(f"model: {ckpt.description}, fp32")
    for precompute in {"both": (False, True), "forward": (False,), "precomputed": (True,)}[args.reference]:
      j = jalign_tokens_per_s(ckpt, args.steps, precompute)
      t = trl_tokens_per_s(ckpt, args.steps, precompute)
      extra = {}
      if args.scan_layers:
        extra["layers scanned"] = jalign_tokens_per_s(ckpt, args.steps, precompute, scan_layers=True)
      if args.whole_sequences:
        extra["whole sequences"] = jalign_tokens_per_s(ckpt, args.steps, precompute, share_prompt=False)
      rows.append((precompute, j, t, extra))
  print(f"DPO, {PAIRS} pairs x ({PROMPT} + {COMPLETION}) tokens, chosen and rejected, CPU; real tokens/s:")
  for precompute, j, t, extra in rows:
    label = "precomputed reference" if precompute else "reference forward   "
    line = f"  {label}  jalign {j:7.0f}  TRL {t:7.0f}  jalign/TRL = {j / t:.2f}x"
    for name, v in extra.items():
      line += f"   ({name}: {v:7.0f}, {v / t:.2f}x)"
    print(line)


if __name__ == "__main__":
  main()
