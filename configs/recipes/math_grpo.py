"""GRPO of any HF (or GGUF) chat model on MATH-style data as it comes ({problem, solution}; the truth is the
solution's last \\boxed{} answer, or an `answer` field where the dataset has one, as MATH-500 does).

    python -m jalign.run --config=configs/recipes/math_grpo.py --config.model.path=MODEL \\
        --config.grpo.prompts='math/train.jsonl' --config.grpo.eval_prompts='math500/test.jsonl'
    ... :smoke                          # CI-sized

The Dr. GRPO settings (Liu et al. 2025) as its MATH runs use them: no std normalisation, no length normalisation, no
KL, clip 0.2, with Qwen2.5-Math's boxed-answer instruction.
"""
from jalign.config import defaults

INSTRUCTION = " Please reason step by step, and put your final answer within \\boxed{}."   # Qwen2.5-Math's prompt


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "grpo"
  c.run_dir = "runs/math_grpo"
  c.data.prompt_suffix = INSTRUCTION
  c.train.update(steps=200, log_every=1, eval_every=50)
  c.optim.update(lr=1e-6, schedule="constant")
  c.sampling.update(max_new_tokens=512, num_samples=8, max_prompt_length=512)
  c.reward.weights = (("boxed", 1.0),)
  c.grpo.update(eval_examples=200, prompts_per_step=16, mini_batches=4, no_signal="skip")
  c.advantage.estimator = "drgrpo"
  c.policy_loss.update(agg="seq-mean-token-sum-norm", clip_high=0.2)
  c.kl.coef = 0.0
  c.checkpoint.update(every=50, keep=1)
  c.log.tensorboard = False
  if arg == "smoke":
    c.run_dir = "runs/math_grpo_smoke"
    c.train.update(steps=2, eval_every=0)
    c.sampling.update(max_new_tokens=16, num_samples=2)
    c.grpo.update(prompts_per_step=4, mini_batches=1, eval_examples=4)
    c.checkpoint.every = 0
  elif arg:
    raise ValueError(f"configs/recipes/math_grpo.py: unknown arg {arg!r}; accepted: 'smoke' or none")
  return c
