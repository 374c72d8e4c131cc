"""Offline rollouts: the shipped tiny policy answers the arithmetic prompts n times each; scored completions go to
a replay buffer (Parquet parts) that offline GRPO/PPO read.

    python -m jalign.run --config=configs/rollout.py
    python -m jalign.run --config=configs/rollout.py:tiny
    python -m jalign.run --config=configs/rollout.py --config.rollout.prompts=data/verl_train.parquet \\
        --config.model.path=path/to/hf_policy --config.tokenizer=path/to/hf_policy
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "rollout"
  c.run_dir = "runs/rollout"
  c.model.path = os.path.join(ASSETS, "tiny_policy")
  # 8 new tokens and 8 samples, as configs/grpo.py trains with: its offline mode reads this buffer as it is.
  c.sampling.update(max_new_tokens=8, num_samples=8, max_prompt_length=48)
  c.rollout.update(prompts="synthetic:arith:train:2048", prompts_per_batch=64)
  if arg == "tiny":
    c.run_dir = "runs/rollout_tiny"
    c.sampling.num_samples = 4
    c.rollout.update(prompts="synthetic:arith:train:64", prompts_per_batch=16)
  elif arg:
    raise ValueError(f"configs/rollout.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
