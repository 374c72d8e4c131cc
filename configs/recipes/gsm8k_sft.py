"""SFT of any HF (or GGUF) chat model on GSM8K's worked solutions, read as they come ({question, answer}).

    python -m jalign.run --config=configs/recipes/gsm8k_sft.py --config.model.path=MODEL \\
        --config.data.train='gsm8k/train.jsonl[:-500]' --config.data.eval='gsm8k/train.jsonl[-500:]'
    ... :smoke                          # a few tiny steps, for CI

MODEL: an HF directory or a llama.cpp .gguf (then --config.tokenizer=DIR with its tokenizer.json). The prompt carries
the instruction the GRPO recipe's verifier reads, so this SFT warm-starts gsm8k_grpo.py.
"""
import ml_collections

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'   # verl's GSM8K prompt


def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.task = "sft"
  c.run_dir = "runs/gsm8k_sft"
  c.tokenizer = ""                     # "" = the model directory's
  c.model = ml_collections.ConfigDict(dict(path="", dtype="float32", remat="full"))
  c.data = ml_collections.ConfigDict(dict(train="", eval="", max_length=512, packing=True, truncation="drop",
                                          prompt_suffix=INSTRUCTION))
  c.train = ml_collections.ConfigDict(dict(steps=500, batch_size=8, seq_len=1024, log_every=10, eval_every=100,
                                           eval_batches=8, eval_examples=0))
  c.optim = ml_collections.ConfigDict(dict(lr=1e-5, schedule="cosine", warmup_steps=15, weight_decay=0.0))
  c.checkpoint = ml_collections.ConfigDict(dict(every=100, keep=1))
  c.log = ml_collections.ConfigDict(dict(progress=True, tensorboard=False))
  if arg == "smoke":
    c.run_dir = "runs/gsm8k_sft_smoke"
    c.data.update(max_length=256)
    c.train.update(steps=2, seq_len=256, log_every=1, eval_every=0, eval_batches=1)
    c.optim.warmup_steps = 1
    c.checkpoint.every = 0
  elif arg:
    raise ValueError(f"configs/recipes/gsm8k_sft.py: unknown arg {arg!r}; accepted: 'smoke' or none")
  return c
