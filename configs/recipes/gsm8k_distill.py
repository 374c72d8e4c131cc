"""Distillation of a stronger GSM8K teacher into any HF (or GGUF) chat model sharing its tokenizer.

    python -m jalign.run --config=configs/recipes/gsm8k_sft.py --config.model.path=TEACHER_BASE   # a teacher, e.g.
    python -m jalign.run --config=configs/recipes/gsm8k_distill.py --config.model.path=MODEL \\
        --config.distill.teacher=runs/gsm8k_sft/hf \\
        --config.grpo.prompts='gsm8k/train.jsonl[:-500]' --config.grpo.eval_prompts='gsm8k/train.jsonl[-500:]'
    ... :gkd / :offline  (then --config.data.train='gsm8k/train.jsonl[:-500]' --config.data.eval=...)
    ... :smoke, :gkd,smoke, :offline,smoke   # a few tiny steps, for CI

The default is on-policy distillation (the student samples, the teacher grades every token: Agarwal et al. 2024;
Lu & Thinking Machines 2025), with the GRPO recipe's sampling and prompt instruction; `gkd` is GKD as TRL runs it
(lmbda 0.5, the JSD at beta 0.5, TRL GKDConfig's defaults); `offline` is the forward KL on the data's worked
solutions (beta 0, plain knowledge distillation), packed like the SFT recipe.
"""
from jalign.config import defaults

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'   # verl's GSM8K prompt
MODES = ("on_policy", "gkd", "offline")


def get_config(arg=None):
  args = [a for a in (arg or "").split(",") if a]
  bad = [a for a in args if a not in MODES + ("smoke",)]
  if bad or sum(a in MODES for a in args) > 1:
    raise ValueError(f"configs/recipes/gsm8k_distill.py: unknown arg {arg!r}; accepted: one of {', '.join(MODES)} "
                     "and/or 'smoke', comma-separated")
  mode = next((a for a in args if a in MODES), "on_policy")
  smoke = "smoke" in args
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "distill"
  c.run_dir = f"runs/gsm8k_distill_{mode}"
  c.model.remat = "full"
  c.distill.mode = mode
  c.data.prompt_suffix = INSTRUCTION
  c.train.update(steps=200, log_every=1, eval_every=50)
  c.optim.update(lr=1e-6, schedule="constant")
  c.checkpoint.update(every=50, keep=1)
  c.log.tensorboard = False
  if mode == "on_policy":
    c.sampling.update(max_new_tokens=256, num_samples=4, max_prompt_length=256)
    c.grpo.update(eval_examples=200, prompts_per_step=16, mini_batches=4)
  else:
    c.data.update(truncation="drop")
    c.train.update(batch_size=8, seq_len=1024, eval_examples=0)
    c.optim.update(lr=1e-5, schedule="cosine", warmup_steps=15)
    if mode == "gkd":
      c.distill.update(beta=0.5, lmbda=0.5)
      c.data.update(packing=False, max_length=512, buckets=(256, 512))
      c.sampling.max_new_tokens = 256
    else:
      c.distill.beta = 0.0
  if smoke:
    c.run_dir += "_smoke"
    c.train.update(steps=2, eval_every=0)
    c.checkpoint.every = 0
    if mode == "on_policy":
      c.sampling.update(max_new_tokens=16, num_samples=2)
      c.grpo.update(prompts_per_step=4, mini_batches=1, eval_examples=4)
    else:
      c.data.max_length = 256
      c.train.update(seq_len=256, eval_batches=1)
      c.optim.warmup_steps = 1
      if mode == "gkd":
        c.data.buckets = (128, 256)
        c.sampling.max_new_tokens = 16
  return c
