"""SFT of any HF (or GGUF) chat model on GSM8K's worked solutions, read as they come ({question, answer}).

    python -m jalign.run --config=configs/recipes/gsm8k_sft.py --config.model.path=MODEL \\
        --config.data.train='gsm8k/train.jsonl[:-500]' --config.data.eval='gsm8k/train.jsonl[-500:]'
    ... :smoke                          # a few tiny steps, for CI

MODEL: an HF directory or a llama.cpp .gguf (then --config.tokenizer=DIR with its tokenizer.json). The prompt carries
the instruction the GRPO recipe's verifier reads, so this SFT warm-starts gsm8k_grpo.py.
"""
from jalign.config import defaults

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'   # verl's GSM8K prompt


def get_config(arg=None):
  c = defaults()  # every key with its default (jalign/config.py); this recipe states what it changes
  c.task = "sft"
  c.run_dir = "runs/gsm8k_sft"
  c.model.remat = "full"
  c.data.update(truncation="drop", prompt_suffix=INSTRUCTION)
  c.train.update(steps=500, batch_size=8, seq_len=1024, eval_every=100, eval_examples=0)
  c.optim.update(lr=1e-5, warmup_steps=15)
  c.checkpoint.update(every=100, keep=1)
  c.log.tensorboard = False
  if arg == "smoke":
    c.run_dir = "runs/gsm8k_sft_smoke"
    c.data.update(max_length=256)
    c.train.update(steps=2, seq_len=256, log_every=1, eval_every=0, eval_batches=1)
    c.optim.warmup_steps = 1
    c.checkpoint.every = 0
  elif arg:
    raise ValueError(f"configs/recipes/gsm8k_sft.py: unknown arg {arg!r}; accepted: 'smoke' or none")
  return c
