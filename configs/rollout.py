"""Offline rollouts: the shipped tiny policy answers the arithmetic prompts n times each; scored completions go to
a replay buffer (Parquet parts) that offline GRPO/PPO read.

    python -m jalign.run --config=configs/rollout.py
    python -m jalign.run --config=configs/rollout.py:tiny
    python -m jalign.run --config=configs/rollout.py --config.rollout.prompts=data/verl_train.parquet \\
        --config.model.path=path/to/hf_policy --config.tokenizer=path/to/hf_policy
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "rollout"
  c.run_dir = "runs/rollout"
  c.seed = 0
  c.tokenizer = ""
  c.model = ml_collections.ConfigDict(dict(path=os.path.join(ASSETS, "tiny_policy"), dtype="float32",
                                           compute_dtype="", scan_layers=True, remat="none"))
  c.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1), rules=jalign.models.DEFAULT_RULES))
  # Multi-process: "" = one process, or the cluster's environment (Cloud TPU pod, SLURM, Open MPI); see
  # jalign/parallel/distributed.py. cpu_devices: CPU devices per process (tests, laptops).
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                                 cpu_devices=0, timeout_s=300))
  # 8 new tokens and 8 samples, as configs/grpo.py trains with: its offline mode reads this buffer as it is.
  c.sampling = ml_collections.ConfigDict(dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                              num_samples=8, max_prompt_length=48, layout="training"))
  c.reward = ml_collections.ConfigDict(dict(weights=(("gsm8k", 1.0),), overlong_max_length=0, overlong_buffer=0,
                                            length_target=0, length_weight=0.0))
  c.rollout = ml_collections.ConfigDict(dict(prompts="synthetic:arith:train:2048", output="", format="parquet",
                                             prompts_per_batch=64, limit=0, min_reward=None))
  c.rollout.min_reward = ml_collections.config_dict.placeholder(float)
  if arg == "tiny":
    c.run_dir = "runs/rollout_tiny"
    c.sampling.num_samples = 4
    c.rollout.update(prompts="synthetic:arith:train:64", prompts_per_batch=16)
  elif arg:
    raise ValueError(f"configs/rollout.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
