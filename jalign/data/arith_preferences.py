"""Demo preference set for the built-in arithmetic task, with gold scores for reward-model evaluation.

For each prompt of the task's train/test split: `chosen` is the correct answer ("#### 85"); `rejected` is an
incorrect answer, preferably one the shipped tiny policy itself samples (the mistakes a preference method should
remove), otherwise a deterministic corruption of the correct one (a wrong digit, a carry slip, a sign flip). Each
record carries `chosen_score` / `rejected_score`: a gold score that falls with the size of the error,
`-log(1 + |answer - truth|)` (0 when correct, -8 when no number can be read), so reward models can be rank-checked
against it.

Reward-model training pairs (`rm_train.jsonl`) are built differently: the same train questions, two pairs each,
rejected = the correct answer with a ones-digit slip (+-1 to 3, the kind of most of the policy's mistakes: 67% of
the test set's rejected answers are off by one). Trained on the policy's own mistakes, the tiny reward model stays
near chance: they are the answers its backbone (the policy) already finds likely, and one mistake per question
repeats the policy's few confusions. Random slips make it verify the ones digit, which carries over to the policy's
mistakes in `test.jsonl` (see benchmarks/README.md). That model does not grade the size of an error (a tens-digit
slip scores like a correct answer), and in this backbone's weights the two checks do not coexist; so the second
member of `configs/rm.py`'s reward model is trained on `rm_magnitude.jsonl` (rejected = a tens-digit slip of +-10
or 20, or the sign flipped) and the two members' scores are summed.

    python -m jalign.data.arith_preferences --out jalign/assets/arith_prefs   # (re)build the shipped set, ~1 min
"""
from __future__ import annotations

import argparse
import json
import math
import os

import numpy as np

from jalign.core import files
from jalign.data import synthetic
from jalign.data.answers import extract_gsm8k, parse_number

UNREADABLE = -8.0
SPLIT_SIZES = {"train": 10_000, "test": 500}
SLIPS = (-3, -2, -1, 1, 2, 3)
TENS_SLIPS = (-20, -10, 10, 20)


def gold_score(completion: str, truth: str) -> float:
  predicted = parse_number(extract_gsm8k(completion))
  if predicted is None:
    return UNREADABLE
  return 0.0 - math.log1p(abs(float(predicted) - float(truth)))


def corrupt(truth: int, rng: np.random.RandomState) -> int:
  """A plausible wrong answer: off by a few in the ones digit, a tens-digit (carry) slip, or the sign flipped."""
  kind = rng.randint(0, 3)
  if kind == 0 or truth == 0:
    wrong = truth + int(rng.choice([-3, -2, -1, 1, 2, 3]))
  elif kind == 1:
    wrong = truth + int(rng.choice([-20, -10, 10, 20]))
  else:
    wrong = -truth
  return wrong if wrong != truth else truth + 1


def build(split: str, policy_dir: str | None, *, n: int | None = None, samples: int = 8, seed: int = 0,
          batch: int = 256) -> list[dict]:
  """Preference records for `split`; with `policy_dir`, rejected answers come from that policy's samples."""
  base = distinct_questions(split, n or SPLIT_SIZES[split], seed=seed)  # one pair per question
  policy_answers: list[list[str]] = [[] for _ in base]
  if policy_dir:
    policy_answers = _sample_policy(base, policy_dir, samples=samples, seed=seed, batch=batch)
  rng = np.random.RandomState(seed + 1)
  out = []
  for r, answers in zip(base, policy_answers):
    truth = r["answer"]
    wrong = [a for a in answers if gold_score(a, truth) < 0 and a.strip()]
    if wrong:  # the policy's most frequent mistake
      values, counts = np.unique(wrong, return_counts=True)
      rejected, origin = str(values[np.argmax(counts)]), "policy"
    else:
      rejected, origin = f"#### {corrupt(int(truth), rng)}", "corruption"
    out.append(_record(r, rejected, origin))
  return out


def _record(question: dict, rejected: str, origin: str) -> dict:
  """A conversational pair for `question`: chosen = its correct answer, with both gold scores."""
  truth = question["answer"]
  chosen = f"#### {truth}"
  return {"prompt": [{"role": "user", "content": question["prompt"]}],
          "chosen": [{"role": "assistant", "content": chosen}],
          "rejected": [{"role": "assistant", "content": rejected}],
          "chosen_score": gold_score(chosen, truth), "rejected_score": gold_score(rejected, truth),
          "answer": truth, "rejected_origin": origin}


def distinct_questions(split: str, n: int, seed: int = 0) -> list[dict]:
  """The first `n` distinct questions among the first 4n records of the task's `split`."""
  out, seen = [], set()
  for r in synthetic.records(split, 4 * n, seed=seed):
    if len(out) == n:
      break
    if r["prompt"] not in seen:
      seen.add(r["prompt"])
      out.append(r)
  return out


def slip_pairs(split: str = "train", n: int | None = None, per_question: int = 2, seed: int = 0) -> list[dict]:
  """`per_question` pairs for each question of `build(split)`: chosen = the correct answer, rejected = it with a
  ones-digit slip (distinct slips per question)."""
  return _wrong_answer_pairs(split, n, per_question, np.random.RandomState(seed + 2), seed, "slip",
                             lambda truth: [truth + d for d in SLIPS])


def magnitude_pairs(split: str = "train", n: int | None = None, per_question: int = 2, seed: int = 0) -> list[dict]:
  """`per_question` pairs for each question of `build(split)`: chosen = the correct answer, rejected = it with a
  tens-digit slip (+-10, 20) or its sign flipped (distinct per question): the second reward-model member's data."""
  return _wrong_answer_pairs(split, n, per_question, np.random.RandomState(seed + 3), seed, "magnitude",
                             lambda truth: [truth + d for d in TENS_SLIPS] + ([-truth] if truth else []))


def _wrong_answer_pairs(split, n, per_question, rng, seed, origin, wrong_answers) -> list[dict]:
  """`per_question` distinct draws from `wrong_answers(truth)` as the rejected answers of each question."""
  out = []
  for r in distinct_questions(split, n or SPLIT_SIZES[split], seed=seed):
    for wrong in rng.choice(wrong_answers(int(r["answer"])), per_question, replace=False):
      out.append(_record(r, f"#### {int(wrong)}", origin))
  return out


def _sample_policy(base: list[dict], policy_dir: str, *, samples: int, seed: int, batch: int) -> list[list[str]]:
  import jax

  from jalign import models, sampling
  from jalign.data.prompts import encode_prompt, left_pad
  from jalign.tokenizers import tokenizer as tokenizer_lib

  lm = models.from_pretrained(policy_dir)
  tok = tokenizer_lib.load(policy_dir)
  prompts = [encode_prompt(r, tok, index=i, where=f"{i}", max_length=64) for i, r in enumerate(base)]
  answers: list[list[str]] = []
  for start in range(0, len(prompts), batch):
    chunk = prompts[start:start + batch]
    ids, mask = left_pad(chunk, tok.pad_id)
    out = sampling.generate(lm, ids, mask, jax.random.fold_in(jax.random.key(seed), start), max_new_tokens=12,
                            temperature=1.0, stop_token_ids=(tok.eos_id,), num_samples=samples, pad_id=tok.pad_id)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [tok.decode(tokens[i, :lengths[i]], skip_special_tokens=True).strip() for i in range(len(tokens))]
    answers.extend(texts[i * samples:(i + 1) * samples] for i in range(len(chunk)))
  return answers


def write_jsonl(records: list[dict], path: str) -> None:
  with files.atomic_open(path) as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def main():
  import jalign
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", required=True, metavar="DIR")
  p.add_argument("--policy", default=os.path.join(os.path.dirname(jalign.__file__), "assets", "tiny_policy"),
                 help="HF policy whose samples supply the rejected answers ('' = corruptions only)")
  p.add_argument("--samples", type=int, default=8, help="samples per prompt")
  args = p.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for split in SPLIT_SIZES:
    records = build(split, args.policy or None, samples=args.samples)
    write_jsonl(records, os.path.join(args.out, f"{split}.jsonl"))
    origin = np.mean([r["rejected_origin"] == "policy" for r in records])
    print(f"{split}: {len(records)} pairs, rejected sampled from the policy for {origin:.1%}")
  records = slip_pairs("train")
  write_jsonl(records, os.path.join(args.out, "rm_train.jsonl"))
  print(f"rm_train: {len(records)} pairs, rejected = a ones-digit slip of the correct answer")
  records = magnitude_pairs("train")
  write_jsonl(records, os.path.join(args.out, "rm_magnitude.jsonl"))
  print(f"rm_magnitude: {len(records)} pairs, rejected = a tens-digit slip or the sign flipped")


if __name__ == "__main__":
  main()
