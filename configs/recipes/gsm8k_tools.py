"""GRPO of any HF (or GGUF) chat model on GSM8K with tools: each sample is an episode in which the model may call a
calculator (or, with `:python`, a sandboxed Python interpreter) before it answers; the loss covers the model's own
tokens, never the tools' outputs.

    python -m jalign.run --config=configs/recipes/gsm8k_tools.py --config.model.path=MODEL \\
        --config.grpo.prompts='gsm8k/train.jsonl[:-500]' --config.grpo.eval_prompts='gsm8k/train.jsonl[-500:]'
    ... :python                          # the Python tool instead of the calculator; :smoke for CI

The tools are shown through the chat template's own tool section where it has one (Qwen, Mistral, Llama 3.1+),
else as a system message; calls are written in the Hermes / Qwen format (`env.tool_format`: llama3, mistral
for those families). Held-out accuracy is measured with the tools and without them (eval/accuracy_no_tools).
GRPO settings (and the smoke size) are configs/recipes/gsm8k_grpo.py's (DeepSeekMath's, as verl runs them).
"""
import importlib.util
import os

INSTRUCTION = ' Use the tool for arithmetic, then output the final answer after "####".'


def get_config(arg=None):
  variant, _, size = (arg or "").partition(",")
  if variant == "smoke":
    variant, size = "", "smoke"
  if variant not in ("", "python"):
    raise ValueError(f"configs/recipes/gsm8k_tools.py: unknown variant {variant!r}; accepted: python, smoke")
  if size not in ("", "smoke"):
    raise ValueError(f"configs/recipes/gsm8k_tools.py: unknown size {size!r}; accepted: smoke")
  spec = importlib.util.spec_from_file_location("recipes_gsm8k_grpo", os.path.join(os.path.dirname(__file__),
                                                                                   "gsm8k_grpo.py"))
  grpo_recipe = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(grpo_recipe)
  c = grpo_recipe.get_config(size or None)  # its GRPO settings and its smoke size
  c.run_dir = f"runs/gsm8k_tools{'_python' if variant else ''}{'_smoke' if size else ''}"
  c.data.prompt_suffix = INSTRUCTION
  # max_new_tokens is per turn; an episode (prompt, turns and tool outputs) stays within env.max_tokens.
  c.sampling.max_prompt_length = 512
  c.env.update(name=variant or "calculator", tool_format="hermes", max_turns=4 if not size else 2,
               max_tokens=1536 if not size else 1024)
  return c
