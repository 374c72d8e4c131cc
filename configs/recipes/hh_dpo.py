"""DPO of any HF (or GGUF) chat model on Anthropic HH-RLHF as it comes (chosen / rejected transcripts split into
messages and a shared prompt).

    python -m jalign.run --config=configs/recipes/hh_dpo.py --config.model.path=MODEL \\
        --config.data.train='hh-rlhf/helpful-base_test.jsonl.gz[:-400]' \\
        --config.data.eval='hh-rlhf/helpful-base_test.jsonl.gz[-400:]'
    ... :smoke                          # CI-sized

The sigmoid loss at beta 0.1 (Rafailov et al. 2023), lr 5e-7 as Zephyr's DPO stage; held-out `rewards/accuracies`
(chosen's implicit reward above rejected's) on the eval pairs. Pairs longer than data.max_length are dropped.
"""
from jalign.config import defaults


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "dpo"
  c.run_dir = "runs/hh_dpo"
  c.model.remat = "full"
  # batches of pairs of similar length (sorted within windows of 32 batches): HH pairs average ~100 tokens but
  # run to 512, and a batch pads to its longest
  c.data.update(truncation="drop", packing=False, max_length_ratio=3.0, skip_bad_records=True, group_by_length=32)
  c.train.update(steps=240, batch_size=8, eval_every=60, eval_batches=50, eval_examples=0)
  c.optim.update(lr=5e-7, schedule="linear", warmup_steps=24)
  c.reward.weights = ()  # no generative check: HH has no verifiable answers
  c.checkpoint.update(every=60, keep=1)
  c.log.tensorboard = False
  if arg == "smoke":
    c.run_dir = "runs/hh_dpo_smoke"
    c.data.update(max_length=192, check_records=64)
    c.train.update(steps=2, seq_len=192, log_every=1, eval_every=0, eval_batches=1)
    c.optim.warmup_steps = 1
    c.checkpoint.every = 0
  elif arg:
    raise ValueError(f"configs/recipes/hh_dpo.py: unknown arg {arg!r}; accepted: 'smoke' or none")
  return c
