"""GRPO of any HF (or GGUF) chat model on GSM8K with tools: each sample is an episode in which the model may call a
calculator (or, with `:python`, a sandboxed Python interpreter) before it answers; the loss covers the model's own
tokens, never the tools' outputs.

    python -m jalign.run --config=configs/recipes/gsm8k_tools.py --config.model.path=MODEL \\
        --config.grpo.prompts='gsm8k/train.jsonl[:-500]' --config.grpo.eval_prompts='gsm8k/train.jsonl[-500:]'
    ... :python                          # the Python tool instead of the calculator; :smoke for CI

The tools are shown through the chat template's own tool section where it has one (Qwen, Mistral, Llama 3.1+),
else as a system message; calls are written in the Hermes / Qwen format (`grpo.env_tool_format`: llama3, mistral
for those families). Held-out accuracy is measured with the tools and without them (eval/accuracy_no_tools).
GRPO settings as configs/recipes/gsm8k_grpo.py (DeepSeekMath's, as verl runs them).
"""
from jalign.config import defaults

INSTRUCTION = ' Use the tool for arithmetic, then output the final answer after "####".'


def get_config(arg=None):
  variant, _, size = (arg or "").partition(",")
  if variant == "smoke":
    variant, size = "", "smoke"
  if variant not in ("", "python"):
    raise ValueError(f"configs/recipes/gsm8k_tools.py: unknown variant {variant!r}; accepted: python, smoke")
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "grpo"
  c.run_dir = f"runs/gsm8k_tools{'_python' if variant else ''}"
  c.data.prompt_suffix = INSTRUCTION
  c.train.update(steps=200, log_every=1, eval_every=50)
  c.optim.update(lr=1e-6, schedule="constant")
  # max_new_tokens is per turn; an episode (prompt, turns and tool outputs) stays within env_max_tokens.
  c.sampling.update(max_new_tokens=256, num_samples=8, max_prompt_length=512)
  c.grpo.update(eval_examples=200, prompts_per_step=16, mini_batches=4, clip_high=0.2, no_signal="skip",
                env=variant or "calculator", env_tool_format="hermes", env_max_turns=4, env_max_tokens=1536)
  c.checkpoint.update(every=50, keep=1)
  c.log.tensorboard = False
  if size == "smoke":
    c.run_dir += "_smoke"
    c.train.update(steps=2, eval_every=0)
    c.sampling.update(max_new_tokens=16, num_samples=2)
    c.grpo.update(prompts_per_step=4, mini_batches=1, eval_examples=4, env_max_turns=2, env_max_tokens=1024)
    c.checkpoint.every = 0
  elif size:
    raise ValueError(f"configs/recipes/gsm8k_tools.py: unknown size {size!r}; accepted: smoke")
  return c
