"""DPO on the built-in arithmetic preference set, starting from (and referenced to) the shipped tiny policy.

    python -m jalign.run --config=configs/dpo.py              # held-out rewards/accuracies and task accuracy
    python -m jalign.run --config=configs/dpo.py:tiny         # seconds, for tests

Other members of the family: --config.dpo.loss_type=ipo|hinge|robust|...|simpo|cpo|orpo|kto (see jalign.losses.dpo;
kto also reads unpaired {"prompt", "completion", "label"} data; on pairs it splits each into its two completions).
The data (`jalign/assets/arith_prefs`) comes from `python -m jalign.data.arith_preferences`.
"""
import os

import jalign
from jalign.config import defaults

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "dpo"
  c.run_dir = "runs/dpo"
  c.model.path = os.path.join(ASSETS, "tiny_policy")  # model.lora.rank > 0: adapters, the base as the reference
  c.data.update(train=os.path.join(ASSETS, "arith_prefs", "train.jsonl"),
                eval=os.path.join(ASSETS, "arith_prefs", "test.jsonl"), max_length=32, packing=False)
  c.train.update(steps=2100, seq_len=32, log_every=25, eval_every=300, eval_batches=16, eval_examples=500)
  # 2100 steps at 3e-4 (cosine to 0.1x): held-out accuracy 66.4% -> 93.4%, held-out rewards/accuracies 0.950,
  # ~7 min on 2 CPU cores (2e-4: 88.6% and 0.894; 300 steps at 5e-5, the first default: 72.2% and 0.656).
  c.optim.update(lr=3e-4, warmup_steps=20, min_lr_ratio=0.1)
  # rpo_alpha: DPO + NLL on the chosen answer (Pang et al. 2024, for reasoning tasks); plain DPO (0.0) on this task
  # lowers the chosen log-probs too and loses held-out accuracy. Each pair's prompt runs through the model once,
  # under both completions (dpo.share_prompt; False: two whole sequences per pair, as TRL runs them).
  c.dpo.update(rpo_alpha=1.0, eval_prompts="synthetic:arith:test")
  c.checkpoint.update(every=300, keep=2)
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
