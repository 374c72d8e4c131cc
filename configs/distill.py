"""Distillation on the built-in arithmetic task: a stronger teacher into the shipped tiny policy.

    python -m jalign.run --config=configs/grpo.py             # first: the teacher (runs/grpo/hf)
    python -m jalign.run --config=configs/distill.py          # on-policy distillation (the student samples)
    python -m jalign.run --config=configs/distill.py:gkd      # GKD: half the batches on the student's samples
    python -m jalign.run --config=configs/distill.py:offline  # KD on the training data
    python -m jalign.run --config=configs/distill.py:tiny     # seconds, for tests (any mode: tiny,gkd ...); the
                                                              # shipped policy teaches a from-scratch student
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")
MODES = ("on_policy", "gkd", "offline")


def get_config(arg=None):
  args = [a for a in (arg or "").split(",") if a]
  unknown = [a for a in args if a not in MODES + ("tiny",)]
  if unknown or sum(a in MODES for a in args) > 1:
    raise ValueError(f"configs/distill.py: arg {arg!r}; accepted: one of {', '.join(MODES)} and/or 'tiny', "
                     "comma-separated")
  mode = next((a for a in args if a in MODES), "on_policy")
  tiny = "tiny" in args
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "distill"
  c.run_dir = f"runs/distill_{mode}"
  c.model.path = os.path.join(ASSETS, "tiny_policy")
  c.distill.update(mode=mode, teacher="runs/grpo/hf")
  c.train.update(seq_len=128, eval_every=100)
  c.optim.update(lr=2e-4, warmup_steps=20, min_lr_ratio=0.1)
  c.checkpoint.update(every=100, keep=2)
  if mode == "on_policy":  # the GRPO demo's sampling and batch: 64 prompts x 8 samples a step
    c.train.steps = 300
    c.sampling.update(max_new_tokens=8, num_samples=8, max_prompt_length=48)
    c.grpo.update(prompts="synthetic:arith:train", eval_prompts="synthetic:arith:test", eval_examples=500,
                  prompts_per_step=64)
  else:  # the SFT demo's data and batch (16 packed rows of 128 tokens, ~100 examples); the teacher at every token
    c.train.update(steps=300, batch_size=16, eval_batches=4, eval_examples=500)
    c.data.update(train="synthetic:arith:train", eval="synthetic:arith:test", max_length=64)
    if mode == "gkd":  # one example a row (the student re-samples its completion): 64 rows of up to 32 tokens
      c.train.batch_size = 64
      c.data.update(packing=False, buckets=(32, 64))
      c.sampling.max_new_tokens = 8
  if tiny:
    c.run_dir = f"runs/distill_{mode}_tiny"
    c.distill.teacher = os.path.join(ASSETS, "tiny_policy")
    c.model.path = ""
    c.tokenizer = os.path.join(ASSETS, "arith_tokenizer")
    c.model.arch = dict(model_type="llama", vocab_size=288, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=128, tie_embeddings=True,
                        eos_token_id=2, pad_token_id=0)
    c.train.update(steps=4, log_every=1, eval_every=0)
    c.optim.update(lr=3e-3, warmup_steps=0, schedule="constant")
    c.checkpoint.every = 2
    c.log.tensorboard = False
    if mode == "on_policy":
      c.sampling.num_samples = 4
      c.grpo.update(prompts_per_step=4, eval_examples=16)
    else:
      c.train.update(batch_size=8, eval_batches=2, eval_examples=16)
  return c
