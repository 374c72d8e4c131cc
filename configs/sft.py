"""SFT on the built-in arithmetic task: trains the tiny policy shipped in jalign/assets/tiny_policy.

    python -m jalign.run --config=configs/sft.py              # the shipped policy (~ minutes on 2 CPU cores)
    python -m jalign.run --config=configs/sft.py:tiny         # seconds, for tests
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "sft"
  c.run_dir = "runs/sft"
  c.tokenizer = os.path.join(ASSETS, "arith_tokenizer")
  # A Llama-architecture model small enough to train on a laptop CPU in minutes (model.lora.rank > 0: adapters).
  c.model.arch = dict(model_type="llama", vocab_size=288, hidden_size=128, intermediate_size=384, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=128, tie_embeddings=True,
                      eos_token_id=2, pad_token_id=0)
  c.data.update(train="synthetic:arith:train", eval="synthetic:arith:test", max_length=64)
  c.train.update(steps=1500, batch_size=16, seq_len=128, log_every=50, eval_every=500, eval_batches=4,
                 eval_examples=500)
  c.optim.update(lr=3e-3, warmup_steps=100, min_lr_ratio=0.1, weight_decay=0.01, b2=0.98)
  c.checkpoint.update(every=500, keep=2)
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
