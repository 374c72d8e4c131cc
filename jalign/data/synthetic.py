"""Built-in verifiable tasks, with their tokenizer: two-number arithmetic (`arith`), and 4-digit multiplication
(`mul`, the tool-use task: see `mul_records`).

Prompts look like "What is 37 + 48?"; the assistant answers "#### 85" (the GSM8K answer convention, so the
"gsm8k" reward of `jalign.rewards.verifiable` scores it). Half the problems have a one-digit second operand (easy), half two
digits (hard, carries and borrows), so a tiny model trained briefly gets some but not all held-out prompts right.
Operand triples are split deterministically between train and test: held-out accuracy measures generalisation, not
recall.

    python -m jalign.data.synthetic --write-tokenizer DIR   # (re)build the shipped tokenizer
"""
from __future__ import annotations

import argparse
import os
import zlib

import numpy as np

from jalign.core.errors import DataError

OPS = ("+", "-")
MAX_OPERAND = 100
SPLITS = {"train": 40_000, "test": 500}
SYSTEM = None  # the template adds none; keeps sequences short


def _is_test(a: int, b: int, op: str) -> bool:
  """A fixed tenth of all (a, b, op) triples, chosen by CRC32 so that the choice is unrelated to the digits (a
  linear rule such as (7a + 13b) % 10 would hold out whole ones-digit pairs, which no model could then learn)."""
  return zlib.crc32(f"{a}{op}{b}".encode()) % 10 == 0


def _answer(a: int, b: int, op: str) -> int:
  return a + b if op == "+" else a - b


def records(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
  """Records with `prompt` (str), `answer` (str) and `messages` (the SFT conversation)."""
  if split not in SPLITS:
    raise DataError(f"synthetic arith split {split!r}; accepted: {', '.join(SPLITS)}")
  n = n or SPLITS[split]
  rng = np.random.RandomState(seed + (0 if split == "train" else 10_007))
  out = []
  while len(out) < n:
    easy = rng.rand() < 0.5
    a = int(rng.randint(0, MAX_OPERAND))
    b = int(rng.randint(0, 10 if easy else MAX_OPERAND))
    op = OPS[int(rng.randint(0, len(OPS)))]
    if _is_test(a, b, op) != (split == "test"):
      continue
    prompt = f"What is {a} {op} {b}?"
    answer = str(_answer(a, b, op))
    out.append({"prompt": prompt, "answer": answer,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"#### {answer}"}]})
  return out


MUL_DIGITS = 4
MUL_SPLITS = {"train": 20_000, "test": 500}


def mul_records(split: str, n: int | None = None, seed: int = 0) -> list[dict]:
  """The tool task: products of two 4-digit numbers, far past what the tiny policy computes, exact with a
  calculator. Records with `prompt`, `answer`, `expression` (the calculator's input) and `messages` (a direct
  answer). Held out as `records` holds out: a CRC32 tenth of the operand pairs."""
  if split not in MUL_SPLITS:
    raise DataError(f"synthetic mul split {split!r}; accepted: {', '.join(MUL_SPLITS)}")
  n = n or MUL_SPLITS[split]
  rng = np.random.RandomState(seed + (1 if split == "train" else 10_009))
  low, high = 10 ** (MUL_DIGITS - 1), 10 ** MUL_DIGITS
  out = []
  while len(out) < n:
    a, b = (int(x) for x in rng.randint(low, high, size=2))
    if _is_test(a, b, "*") != (split == "test"):
      continue
    prompt, answer = f"What is {a} * {b}?", str(a * b)
    out.append({"prompt": prompt, "answer": answer, "expression": f"{a}*{b}",
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": f"#### {answer}"}]})
  return out


TASKS = {"arith": records, "mul": mul_records}


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(out_dir: str, vocab_size: int = 320) -> None:
  """A byte-level BPE over the task's text with single-digit tokens, ChatML template, eos = <|im_end|>."""
  import json

  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  tk = Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                              pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tk.decoder = decoders.ByteLevel()
  corpus = []
  for r in records("train", 5000):
    corpus += [r["prompt"], r["messages"][1]["content"], "user", "assistant", "system"]
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tk.train_from_iterator(corpus, trainer)
  os.makedirs(out_dir, exist_ok=True)
  tk.save(os.path.join(out_dir, "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE, "model_max_length": 64}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
    f.write("\n")


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--write-tokenizer", required=True, metavar="DIR")
  build_tokenizer(p.parse_args().write_tokenizer)


if __name__ == "__main__":
  main()
