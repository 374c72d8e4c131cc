"""Bradley-Terry reward models on the built-in arithmetic preference set, starting from the shipped tiny policy: two
models (one per kind of mistake) whose scores are summed, exported as run_dir/hf (the first) and run_dir/ensemble.

    python -m jalign.run --config=configs/rm.py              # held-out pairwise accuracy and Spearman vs gold
    python -m jalign.run --config=configs/rm.py --config.rm.members="()"    # one reward model, no ensemble
    python -m jalign.run --config=configs/rm.py:tiny         # seconds, for tests

The data (`jalign/assets/arith_prefs`) comes from `python -m jalign.data.arith_preferences`.
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "rm"
  c.run_dir = "runs/rm"
  c.seed = 0
  c.tokenizer = ""
  c.model = ml_collections.ConfigDict(dict(
      path=os.path.join(ASSETS, "tiny_policy"), arch=None, dtype="float32", compute_dtype="", scan_layers=True,
      remat="none",
      # Low-rank adapters (and the score head) instead of full fine-tuning: rank > 0.
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets=("all-linear",)))))
  c.data = ml_collections.ConfigDict(dict(
      # Trained on ones-digit slips of correct answers (two per question), evaluated on the tiny policy's own
      # mistakes: see jalign/data/arith_preferences.py.
      train=os.path.join(ASSETS, "arith_prefs", "rm_train.jsonl"),
      eval=os.path.join(ASSETS, "arith_prefs", "test.jsonl"),
      max_length=32, truncation="keep_start", packing=False, buckets=(), shuffle=True, skip_bad_records=False,
      read_threads=0, pair_checks="warn", max_length_ratio=1.5, pairs_per_prompt=2, check_records=0))
  c.train = ml_collections.ConfigDict(dict(
      steps=3000, batch_size=32, micro_batches=1, seq_len=32, log_every=100, eval_every=500, eval_batches=4,
      eval_examples=500, nonfinite="stop"))
  # The loss sits near ln 2 for the first ~500-1000 steps before the ones-digit check forms; 5e-4 never left it.
  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-4, schedule="cosine", warmup_steps=30, min_lr_ratio=0.1, weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8,
      clip_norm=1.0))
  # Two members: the model above learns to check the ones digit and stays blind to the tens digit and the sign;
  # trained on both kinds of pairs this backbone learns one check or the other, not both (benchmarks/README.md). A
  # second model learns the other check from its own pairs; the ensemble sums the two scores (run_dir/ensemble).
  c.rm = ml_collections.ConfigDict(dict(
      head="linear", head_bias=False, mlp_size=0, center_rewards_coefficient=0.01, share_prompt=True,
      members=(dict(train=os.path.join(ASSETS, "arith_prefs", "rm_magnitude.jsonl"), steps=2000, weight=1.0),)))
  c.mesh = ml_collections.ConfigDict(dict(shape=(1, -1, 1), rules=jalign.models.DEFAULT_RULES))
  c.checkpoint = ml_collections.ConfigDict(dict(every=500, keep=2, resume=True, export_hf=True, async_save=True,
                                              preempt_grace_s=30.0))
  c.log = ml_collections.ConfigDict(dict(progress=True, jsonl=True, tensorboard=True, wandb=False,
                                         wandb_project="jalign", peak_flops=0.0))
  c.logprobs = ml_collections.ConfigDict(dict(impl="auto"))
  # Multi-process: "" = one process, or the cluster's environment (Cloud TPU pod, SLURM, Open MPI); see
  # jalign/parallel/distributed.py. cpu_devices: CPU devices per process (tests, laptops).
  c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=0, process_id=-1,
                                                 cpu_devices=0, timeout_s=300))
  if arg == "tiny":
    c.run_dir = "runs/rm_tiny"
    c.train.update(steps=6, batch_size=8, log_every=2, eval_every=0, eval_batches=2, eval_examples=32)
    c.optim.warmup_steps = 2
    c.data.check_records = 200
    c.checkpoint.every = 3
    c.log.tensorboard = False
    c.rm.members = (dict(c.rm.members[0], steps=4),)
  elif arg:
    raise ValueError(f"configs/rm.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
