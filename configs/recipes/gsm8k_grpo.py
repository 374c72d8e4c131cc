"""GRPO of any HF (or GGUF) chat model on GSM8K as it comes ({question, answer}; the truth is the number after ####).

    python -m jalign.run --config=configs/recipes/gsm8k_grpo.py --config.model.path=MODEL \\
        --config.grpo.prompts='gsm8k/train.jsonl[:-500]' --config.grpo.eval_prompts='gsm8k/train.jsonl[-500:]'
    ... :drgrpo / :dapo                 # the literature's variants (below); :smoke for CI

Defaults follow DeepSeekMath's GRPO (Shao et al. 2024) as verl runs it (group std normalisation, KL loss 0.001,
token-mean); `drgrpo` is Dr. GRPO (Liu et al. 2025: no std normalisation, no length normalisation, no KL); `dapo`
is DAPO (Yu et al. 2025: clip-higher 0.28, dynamic sampling, token-mean, overlong shaping, no KL).
"""
from jalign.config import defaults

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'   # verl's GSM8K prompt


def get_config(arg=None):
  variant, _, size = (arg or "").partition(",")
  if variant == "smoke":
    variant, size = "", "smoke"
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "grpo"
  c.run_dir = f"runs/gsm8k_{variant or 'grpo'}"
  c.data.prompt_suffix = INSTRUCTION
  c.train.update(steps=200, log_every=1, eval_every=50)
  c.optim.update(lr=1e-6, schedule="constant")
  c.sampling.update(max_new_tokens=256, num_samples=8, max_prompt_length=256)
  c.grpo.update(eval_examples=200, prompts_per_step=16, mini_batches=4, no_signal="skip")
  c.policy_loss.clip_high = 0.2
  c.checkpoint.update(every=50, keep=1)
  c.log.tensorboard = False
  if variant == "drgrpo":
    c.advantage.estimator = "drgrpo"
    c.policy_loss.agg = "seq-mean-token-sum-norm"
    c.kl.coef = 0.0
  elif variant == "dapo":
    c.grpo.update(dynamic_sampling=True, max_gen_batches=3)
    c.policy_loss.clip_high = 0.28
    c.kl.coef = 0.0
    c.reward.update(overlong_max_length=c.sampling.max_new_tokens, overlong_buffer=c.sampling.max_new_tokens // 4)
  elif variant:
    raise ValueError(f"configs/recipes/gsm8k_grpo.py: unknown variant {variant!r}; accepted: drgrpo, dapo, smoke")
  if size == "smoke":
    c.run_dir += "_smoke"
    c.train.update(steps=2, eval_every=0)
    c.sampling.update(max_new_tokens=16, num_samples=2)
    c.grpo.update(prompts_per_step=4, mini_batches=1, eval_examples=4)
    c.reward.update(overlong_max_length=0, overlong_buffer=0)
    c.checkpoint.every = 0
  elif size:
    raise ValueError(f"configs/recipes/gsm8k_grpo.py: unknown size {size!r}; accepted: smoke")
  return c
