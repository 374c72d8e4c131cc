"""Evaluate a policy checkpoint (any HF-format causal LM directory) on held-out prompts of the built-in task.

    python -m jalign.run --config=configs/eval.py --config.model.path=runs/grpo/hf
    python -m jalign.run --config=configs/eval.py --config.model.path=DIR --config.eval.reference=OTHER_DIR \
        --config.eval.reward_model=runs/rm/ensemble --config.eval.num_samples=8 --config.eval.pass_k="(1,4,8)"

Writes run_dir/eval.json: accuracy (greedy pass@1), pass@k, response length, reward-model score, win rate and KL
against the reference, perplexity on held-out SFT data, the reward model's pairwise accuracy on held-out pairs.
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "eval"
  c.run_dir = "runs/eval"
  c.seed = 0
  c.tokenizer = ""                      # "" = the checkpoint's own tokenizer files
  c.model = ml_collections.ConfigDict(dict(path=os.path.join(ASSETS, "tiny_policy")))
  c.eval = ml_collections.ConfigDict(dict(
      prompts="synthetic:arith:test", examples=500, metric="gsm8k", max_new_tokens=16, num_samples=8,
      pass_k=(1, 4, 8), temperature=1.0, reference=os.path.join(ASSETS, "tiny_policy"), reward_model="",
      judge="auto", sft_data="synthetic:arith:test", pairs="", batch_size=128, seed=0))
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                                 cpu_devices=0, timeout_s=300))
  if arg == "tiny":
    c.run_dir = "runs/eval_tiny"
    c.eval.update(examples=16, num_samples=2, pass_k=(1, 2), batch_size=16)
  elif arg:
    raise ValueError(f"configs/eval.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
