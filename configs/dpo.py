"""DPO on the built-in arithmetic preference set, starting from (and referenced to) the shipped tiny policy.

    python -m jalign.run --config=configs/dpo.py              # held-out rewards/accuracies and task accuracy
    python -m jalign.run --config=configs/dpo.py:tiny         # seconds, for tests

Other members of the family: --config.dpo.loss_type=ipo|hinge|robust|...|simpo|cpo|orpo|kto (see jalign.losses.dpo;
kto also reads unpaired {"prompt", "completion", "label"} data; on pairs it splits each into its two completions).
The data (`jalign/assets/arith_prefs`) comes from `python -m jalign.data.arith_preferences`.
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "dpo"
  c.run_dir = "runs/dpo"
  c.seed = 0
  c.tokenizer = ""
  c.model = ml_collections.ConfigDict(dict(
      path=os.path.join(ASSETS, "tiny_policy"), arch=None, dtype="float32", compute_dtype="", scan_layers=True,
      remat="none", offload_reference=False,   # True: the reference waits in host memory between its forwards
      # Low-rank adapters instead of full fine-tuning: rank > 0 (e.g. 16); the reference is then the base model.
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets=("all-linear",)))))
  c.data = ml_collections.ConfigDict(dict(
      train=os.path.join(ASSETS, "arith_prefs", "train.jsonl"), eval=os.path.join(ASSETS, "arith_prefs", "test.jsonl"),
      max_length=32, truncation="keep_start", packing=False, buckets=(), shuffle=True, skip_bad_records=False,
      read_threads=0, pair_checks="warn", max_length_ratio=1.5, pairs_per_prompt=1,
      check_records=0))
  c.train = ml_collections.ConfigDict(dict(
      steps=2100, batch_size=32, micro_batches=1, seq_len=32, log_every=25, eval_every=300, eval_batches=16,
      eval_examples=500, nonfinite="stop"))
  # 2100 steps at 3e-4 (cosine to 0.1x): held-out accuracy 66.4% -> 93.4%, held-out rewards/accuracies 0.950,
  # ~7 min on 2 CPU cores (2e-4: 88.6% and 0.894; 300 steps at 5e-5, the first default: 72.2% and 0.656).
  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-4, schedule="cosine", warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
      clip_norm=1.0))
  c.dpo = ml_collections.ConfigDict(dict(
      # rpo_alpha: DPO + NLL on the chosen answer (Pang et al. 2024, for reasoning tasks); plain DPO (0.0) on this
      # task lowers the chosen log-probs too and loses held-out accuracy.
      loss_type="sigmoid", beta=0.1, label_smoothing=0.0, simpo_gamma=0.5, cpo_alpha=1.0, discopop_tau=0.05,
      rpo_alpha=1.0, precompute_ref_logps=False, sync_ref_model=False, ref_model_mixup_alpha=0.6,
      ref_model_sync_steps=512, eval_prompts="synthetic:arith:test", eval_examples=500, eval_max_new_tokens=16,
      # Each pair's prompt runs through the model once, under both completions (prefix sharing; False: two whole
      # sequences per pair, as TRL runs them).
      share_prompt=True))
  c.reward = ml_collections.ConfigDict(dict(weights=(("gsm8k", 1.0),)))
  c.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1), rules=jalign.models.DEFAULT_RULES))
  c.checkpoint = ml_collections.ConfigDict(dict(every=300, keep=2, resume=True, export_hf=True, async_save=True,
                                              preempt_grace_s=30.0))
  c.log = ml_collections.ConfigDict(dict(progress=True, jsonl=True, tensorboard=True, wandb=False,
                                         wandb_project="jalign", peak_flops=0.0))
  c.logprobs = ml_collections.ConfigDict(dict(impl="auto"))
  # Multi-process: "" = one process, or the cluster's environment (Cloud TPU pod, SLURM, Open MPI); see
  # jalign/parallel/distributed.py. cpu_devices: CPU devices per process (tests, laptops).
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                                 cpu_devices=0, timeout_s=300))
  if arg == "tiny":
    c.run_dir = "runs/dpo_tiny"
    c.train.update(steps=6, batch_size=8, log_every=2, eval_every=0, eval_batches=2, eval_examples=32)
    c.optim.warmup_steps = 2
    c.data.check_records = 200
    c.dpo.eval_examples = 32
    c.checkpoint.every = 3
    c.log.tensorboard = False
  elif arg:
    raise ValueError(f"configs/dpo.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
