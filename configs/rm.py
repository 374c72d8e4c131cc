"""Bradley-Terry reward models on the built-in arithmetic preference set, starting from the shipped tiny policy: two
models (one per kind of mistake) whose scores are summed, exported as run_dir/hf (the first) and run_dir/ensemble.

    python -m jalign.run --config=configs/rm.py              # held-out pairwise accuracy and Spearman vs gold
    python -m jalign.run --config=configs/rm.py --config.rm.members="()"    # one reward model, no ensemble
    python -m jalign.run --config=configs/rm.py:tiny         # seconds, for tests

The data (`jalign/assets/arith_prefs`) comes from `python -m jalign.data.arith_preferences`.
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "rm"
  c.run_dir = "runs/rm"
  c.model.path = os.path.join(ASSETS, "tiny_policy")  # model.lora.rank > 0: adapters and the score head
  # Trained on ones-digit slips of correct answers (two per question), evaluated on the tiny policy's own mistakes:
  # see jalign/data/arith_preferences.py.
  c.data.update(train=os.path.join(ASSETS, "arith_prefs", "rm_train.jsonl"),
                eval=os.path.join(ASSETS, "arith_prefs", "test.jsonl"), max_length=32, packing=False,
                pairs_per_prompt=2)
  c.train.update(steps=3000, seq_len=32, log_every=100, eval_every=500, eval_batches=4, eval_examples=500)
  # The loss sits near ln 2 for the first ~500-1000 steps before the ones-digit check forms; 5e-4 never left it.
  c.optim.update(lr=3e-4, warmup_steps=30, min_lr_ratio=0.1)
  # Two members: the model above learns to check the ones digit and stays blind to the tens digit and the sign;
  # trained on both kinds of pairs this backbone learns one check or the other, not both (benchmarks/README.md). A
  # second model learns the other check from its own pairs; the ensemble sums the two scores (run_dir/ensemble).
  c.rm.update(center_rewards_coefficient=0.01,
              members=(dict(train=os.path.join(ASSETS, "arith_prefs", "rm_magnitude.jsonl"), steps=2000, weight=1.0),))
  c.checkpoint.update(every=500, keep=2)
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
