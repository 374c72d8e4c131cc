"""SFT on the built-in arithmetic task: trains the tiny policy shipped in jalign/assets/tiny_policy.

    python -m jalign.run --config=configs/sft.py              # the shipped policy (~ minutes on 2 CPU cores)
    python -m jalign.run --config=configs/sft.py:tiny         # seconds, for tests
"""
import os

import ml_collections

import jalign

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "sft"
  c.run_dir = "runs/sft"
  c.seed = 0
  c.tokenizer = os.path.join(ASSETS, "arith_tokenizer")
  c.model = ml_collections.ConfigDict(dict(
      path="", dtype="float32", compute_dtype="", scan_layers=True, remat="none",
      # rank > 0: low-rank adapters instead of full fine-tuning
      lora=ml_collections.ConfigDict(dict(rank=0, alpha=16.0, dropout=0.0, targets=("all-linear",))),
      # A Llama-architecture model small enough to train on a laptop CPU in minutes.
      arch=ml_collections.ConfigDict(dict(
          model_type="llama", vocab_size=288, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
          num_kv_heads=2, head_dim=32, max_position_embeddings=128, tie_embeddings=True, eos_token_id=2,
          pad_token_id=0))))
  c.data = ml_collections.ConfigDict(dict(
      train="synthetic:arith:train", eval="synthetic:arith:test", max_length=64, truncation="keep_start",
      packing=True, buckets=(), shuffle=True, skip_bad_records=False, read_threads=0, num_packing_bins=0))
  c.train = ml_collections.ConfigDict(dict(
      steps=1500, batch_size=16, micro_batches=1, seq_len=128, log_every=50, eval_every=500, eval_batches=4,
      eval_examples=500, nonfinite="stop"))
  c.optim = ml_collections.ConfigDict(dict(
      lr=3e-3, schedule="cosine", warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.01, b1=0.9, b2=0.98, eps=1e-8,
      clip_norm=1.0))
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
    c.run_dir = "runs/sft_tiny"
    c.model.arch.update(hidden_size=32, intermediate_size=64, num_layers=2, head_dim=16)
    c.train.update(steps=8, batch_size=8, seq_len=64, log_every=2, eval_every=0, eval_batches=2, eval_examples=32)
    c.optim.warmup_steps = 2
    c.checkpoint.every = 4
    c.log.tensorboard = False
  elif arg:
    raise ValueError(f"configs/sft.py: unknown arg {arg!r}; accepted: 'tiny' or none")
  return c
