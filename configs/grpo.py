"""GRPO on the built-in arithmetic task, starting from the shipped tiny policy: the job users run first.

    python -m jalign.run --config=configs/grpo.py           # minutes on 2 CPU cores; prints held-out accuracy
    python -m jalign.run --config=configs/grpo.py:tiny      # seconds, for tests
    # offline, from a replay buffer written by configs/rollout.py (same num_samples):
    python -m jalign.run --config=configs/grpo.py --config.grpo.buffer=runs/rollout/buffer
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "grpo"
  c.run_dir = "runs/grpo"
  c.seed = 0
  c.tokenizer = ""
  c.model = ml_collections.ConfigDict(dict(path=os.path.join(ASSETS, "tiny_policy"), dtype="float32",
                                           compute_dtype="", scan_layers=True, remat="none",
                                           offload_reference=False,  # True: the reference waits in host memory
                                           # LoRA instead of full fine-tuning: rank > 0; the reference is the base
                                           lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0,
                                                                               targets=("all-linear",)))))
  # 1300 steps x 64 prompts x 8 samples, lr 2e-4 with warmup and cosine decay: about 8-10 minutes on 2 CPU cores.
  c.train = ml_collections.ConfigDict(dict(steps=1300, batch_size=8, micro_batches=1, seq_len=128, log_every=10,
                                           eval_every=150, eval_batches=1, eval_examples=0,
                                           nonfinite="stop"))
  c.optim = ml_collections.ConfigDict(dict(lr=2e-4, schedule="cosine", warmup_steps=20, min_lr_ratio=0.1,
                                           weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, clip_norm=1.0))
  c.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1), rules=jalign.models.DEFAULT_RULES))
  c.sampling = ml_collections.ConfigDict(dict(max_new_tokens=8, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                                              num_samples=8, max_prompt_length=48, layout="training"))
  c.reward = ml_collections.ConfigDict(dict(weights=(("gsm8k", 1.0),), overlong_max_length=0, overlong_buffer=0,
                                            length_target=0, length_weight=0.0))
  c.grpo = ml_collections.ConfigDict(dict(
      # One on-policy update per step over 64 prompts x 8 samples (no separate old-policy forward). No KL term in
      # the loss (kl_coef=0, as DAPO): the reference then runs only on the steps that report the KL to it, 14% less
      # time per step for the same held-out accuracy as kl_coef=0.001 (benchmarks/README.md, four seeds each).
      prompts="synthetic:arith:train", buffer="", prompts_per_step=64, mini_batches=1, ppo_epochs=1,
      adv_estimator="grpo", gamma=1.0, lam=1.0, critic_lr=1e-5, value_clip=0.5, critic_warmup=0,
      clip_low=0.2, clip_high=0.28, loss_mode="vanilla", agg="token-mean", kl_coef=0.0, kl_kind="k3",
      kl_in_reward=False, kl_ctrl="fixed", kl_target=0.1, kl_horizon=10000,
      entropy_coef=0.0, dynamic_sampling=True, max_gen_batches=1, compact_sizes=4, share_prompts=True,
      eval_prompts="synthetic:arith:test",
      eval_examples=500,
      max_kl=0.0, max_kl_action="stop", kl_lr_factor=0.5, entropy_floor=0.01,
      no_signal="skip",   # a step whose groups all score alike has no gradient signal: skip its update
      tis_imp_ratio_cap=0.0))  # offline only: > 0 weights tokens by min(pi_old / pi_behaviour, cap)
  c.grpo.clip_c = ml_collections.config_dict.placeholder(float)
  c.checkpoint = ml_collections.ConfigDict(dict(every=150, keep=2, resume=True, export_hf=True, async_save=True,
                                              preempt_grace_s=30.0))
  c.log = ml_collections.ConfigDict(dict(progress=True, jsonl=True, tensorboard=True, wandb=False,
                                         wandb_project="jalign", peak_flops=0.0))
  c.logprobs = ml_collections.ConfigDict(dict(impl="auto"))
  # Multi-process: "" = one process, or the cluster's environment (Cloud TPU pod, SLURM, Open MPI); see
  # jalign/parallel/distributed.py. cpu_devices: CPU devices per process (tests, laptops).
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                                 cpu_devices=0, timeout_s=300))
  if arg == "tiny":
    c.run_dir = "runs/grpo_tiny"
    c.train.update(steps=3, log_every=1, eval_every=0)
    c.optim.update(lr=1e-4, schedule="constant", warmup_steps=0)
    # kl_coef > 0: the tiny runs exercise the KL term and the every-step reference forward
    c.grpo.update(prompts_per_step=4, mini_batches=2, eval_examples=16, compact_sizes=0, kl_coef=0.001)
    c.sampling.num_samples = 4
    c.checkpoint.every = 2
    c.log.tensorboard = False
  elif arg:
    raise ValueError(f"configs/grpo.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
