"""GRPO on the built-in arithmetic task, starting from the shipped tiny policy: the job users run first.

    python -m jalign.run --config=configs/grpo.py           # minutes on 2 CPU cores; prints held-out accuracy
    python -m jalign.run --config=configs/grpo.py:tiny      # seconds, for tests
    # asynchronous: each step trains on rollouts of the policy one update older, sampled during the previous update
    python -m jalign.run --config=configs/grpo.py --config.grpo.async_staleness=1
    # offline, from a replay buffer written by configs/rollout.py (same num_samples):
    python -m jalign.run --config=configs/grpo.py --config.grpo.buffer=runs/rollout/buffer
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "grpo"
  c.run_dir = "runs/grpo"
  c.model.path = os.path.join(ASSETS, "tiny_policy")
  # 1300 steps x 64 prompts x 8 samples, lr 2e-4 with warmup and cosine decay: about 8-10 minutes on 2 CPU cores.
  c.train.update(steps=1300, seq_len=128, eval_every=150)
  c.optim.update(lr=2e-4, warmup_steps=20, min_lr_ratio=0.1)
  c.sampling.update(max_new_tokens=8, num_samples=8, max_prompt_length=48)
  # One on-policy update per step over 64 prompts x 8 samples (no separate old-policy forward). No KL term in the
  # loss (kl.coef=0, as DAPO): the reference then runs only on the steps that report the KL to it, 14% less time per
  # step for the same held-out accuracy as kl.coef=0.001 (benchmarks/README.md, four seeds each). Groups whose
  # samples all score alike are left out of the update (dynamic sampling, compact_sizes); a step with none left
  # skips its update (no_signal="skip").
  c.grpo.update(prompts="synthetic:arith:train", eval_prompts="synthetic:arith:test", eval_examples=500,
                prompts_per_step=64, dynamic_sampling=True, compact_sizes=4, no_signal="skip")
  c.kl.coef = 0.0
  c.checkpoint.update(every=150, keep=2)
  if arg == "tiny":
    c.run_dir = "runs/grpo_tiny"
    c.train.update(steps=3, log_every=1, eval_every=0)
    c.optim.update(lr=1e-4, schedule="constant", warmup_steps=0)
    # kl.coef > 0: the tiny runs exercise the KL term and the every-step reference forward
    c.grpo.update(prompts_per_step=4, mini_batches=2, eval_examples=16, compact_sizes=0)
    c.kl.coef = 0.001
    c.sampling.num_samples = 4
    c.checkpoint.every = 2
    c.log.tensorboard = False
  elif arg:
    raise ValueError(f"configs/grpo.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
