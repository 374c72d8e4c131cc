"""A Bradley-Terry reward model from any HF (or GGUF) model on Anthropic HH-RLHF as it comes (chosen / rejected
transcripts "\\n\\nHuman: ...\\n\\nAssistant: ...", split into messages and a shared prompt).

    python -m jalign.run --config=configs/recipes/hh_rm.py --config.model.path=MODEL \\
        --config.data.train='hh-rlhf/helpful-base_test.jsonl.gz[:-400]' \\
        --config.data.eval='hh-rlhf/helpful-base_test.jsonl.gz[-400:]'
    ... :smoke                          # CI-sized

One epoch at lr 1e-5 with a linear head on the last token, as TRL's RewardTrainer defaults; the held-out pairwise
accuracy is `eval/pairwise_accuracy`, over the first train.eval_batches x train.batch_size held-out pairs (all 382 at
50 x 8). Pairs longer than data.max_length are dropped, not cut (the run says how many at start).
"""
from jalign.config import defaults


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "rm"
  c.run_dir = "runs/hh_rm"
  c.model.remat = "full"
  # batches of pairs of similar length (sorted within windows of 32 batches): HH pairs average ~100 tokens but
  # run to 512, and a batch pads to its longest
  c.data.update(truncation="drop", packing=False, max_length_ratio=3.0, skip_bad_records=True, group_by_length=32)
  c.train.update(steps=240, batch_size=8, eval_every=60, eval_batches=50, eval_examples=0)
  c.optim.update(lr=1e-5, schedule="linear")
  c.checkpoint.update(every=60, keep=1)
  c.log.tensorboard = False
  if arg == "smoke":
    c.run_dir = "runs/hh_rm_smoke"
    c.data.update(max_length=192, check_records=64)
    c.train.update(steps=2, seq_len=192, log_every=1, eval_every=0, eval_batches=1)
    c.checkpoint.every = 0
  elif arg:
    raise ValueError(f"configs/recipes/hh_rm.py: unknown arg {arg!r}; accepted: 'smoke' or none")
  return c
