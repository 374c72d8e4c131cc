"""Evaluate a policy checkpoint (any HF-format causal LM directory) on held-out prompts of the built-in task.

    python -m jalign.run --config=configs/eval.py --config.model.path=runs/grpo/hf \
        --config.eval.reference=jalign/assets/tiny_policy      # win rate and KL against the shipped policy
    python -m jalign.run --config=configs/eval.py --config.model.path=DIR --config.eval.reference=OTHER_DIR \
        --config.eval.reward_model=runs/rm/ensemble --config.eval.num_samples=8 --config.eval.pass_k="(1,4,8)"

Writes run_dir/eval.json: accuracy (greedy pass@1), pass@k, response length, reward-model score, win rate and KL
against the reference, perplexity on held-out SFT data, the reward model's pairwise accuracy on held-out pairs.
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "eval"
  c.run_dir = "runs/eval"
  c.model.path = os.path.join(ASSETS, "tiny_policy")   # tokenizer "" = the checkpoint's own tokenizer files
  # No reference by default: the win rate and the KL need one with the model's tokenizer (the shipped policy's, for
  # the demo's checkpoints: --config.eval.reference=jalign/assets/tiny_policy).
  c.eval.update(examples=500, num_samples=8, pass_k=(1, 4, 8), sft_data="synthetic:arith:test")
  if arg == "tiny":
    c.run_dir = "runs/eval_tiny"
    c.eval.update(examples=16, num_samples=2, pass_k=(1, 2), batch_size=16)
  elif arg:
    raise ValueError(f"configs/eval.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
