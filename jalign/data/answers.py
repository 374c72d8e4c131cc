"""Answers as datasets write them and as graders read them: GSM8K's `#### N`, MATH's last `\\boxed{}`, plain numbers,
and the comparison of a predicted answer with the truth. Shared by the dataset layouts (which reduce a worked
solution to its answer) and the verifiable rewards."""
from __future__ import annotations

import re
from fractions import Fraction

NUMBER = r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+"
_GSM8K = re.compile(r"####\s*(" + NUMBER + ")")
_ANY_NUMBER = re.compile(NUMBER)


def parse_number(text: str | None) -> Fraction | None:
  """'1,234.50' -> Fraction(2469, 2); None when `text` is not a plain decimal number."""
  if text is None:
    return None
  text = text.strip().replace(",", "").rstrip(".")
  if text.startswith("$"):
    text = text[1:]
  if not re.fullmatch(r"-?(\d+(\.\d*)?|\.\d+)", text):
    return None
  return Fraction(text)


def extract_gsm8k(text: str) -> str | None:
  """The number after the last '####' (GSM8K's answer convention, as verl's gsm8k scorer reads it)."""
  found = _GSM8K.findall(text)
  return found[-1] if found else None


def extract_boxed(text: str) -> str | None:
  """Contents of the last \\boxed{...} or \\fbox{...} (braces balanced), as MATH's graders read it."""
  start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
  if start < 0:
    return None
  i = text.find("{", start)
  if i < 0:
    return None
  depth = 0
  for j in range(i, len(text)):
    depth += {"{": 1, "}": -1}.get(text[j], 0)
    if depth == 0:
      return text[i + 1:j]
  return None


def extract_last_number(text: str) -> str | None:
  found = _ANY_NUMBER.findall(text)
  return found[-1] if found else None


def _normalise(answer: str | None) -> str | None:
  if answer is None:
    return None
  answer = answer.strip().strip("$").replace(" ", "").replace("\\!", "")
  answer = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
  return answer.rstrip(".")


def answers_match(predicted: str | None, truth: str) -> bool:
  """Numeric equality when both parse as numbers, else equality of normalised strings."""
  if predicted is None:
    return False
  a, b = parse_number(predicted), parse_number(truth)
  if a is not None and b is not None:
    return a == b
  return _normalise(predicted) == _normalise(truth)
