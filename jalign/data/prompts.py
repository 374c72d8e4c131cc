"""Prompt records -> token ids: the `prompt` field (a string or a message list) rendered with the chat template and its
generation prompt, the ground truth its reward reads, and left padding to the sampler's bucket."""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jalign import sampling
from jalign.core.errors import DataError
from jalign.data.layouts import NAMES
from jalign.data.scan import Tally, scan
from jalign.data.sft import TooLong
from jalign.tokenizers.tokenizer import Tokenizer


class PromptError(DataError):
  """A prompt record that cannot be used; the message names the record."""


class PromptTooLong(PromptError, TooLong):
  """A prompt longer than the sampler allows."""


@dataclasses.dataclass(frozen=True)
class Prompt:
  index: int               # position in the prompt source (the GRPO group id)
  ids: list[int]
  text: str
  ground_truth: str | None
  where: str


def ground_truth_of(record: dict) -> str | None:
  """`answer`, `ground_truth`, or verl's `reward_model.ground_truth`."""
  for key in ("answer", "ground_truth"):
    if record.get(key) is not None:
      return str(record[key])
  rm = record.get("reward_model")
  if isinstance(rm, dict) and rm.get("ground_truth") is not None:
    return str(rm["ground_truth"])
  return None


def encode_prompt(record: Any, tok: Tokenizer, *, index: int, where: str, max_length: int) -> Prompt:
  """`prompt` as a string (one user turn) or a message list (verl's layout), rendered with the chat template and
  its generation prompt (plain encoding when the tokenizer has no template)."""
  at = f"{where}: " if where else ""
  if not isinstance(record, dict) or "prompt" not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise PromptError(f"{at}record has no 'prompt' field (it has {keys}); name the prompt's field with "
                      "data.prompt_key, or a layout with data.layout (accepted: " + ", ".join(NAMES) + ")")
  prompt = record["prompt"]
  if isinstance(prompt, str):
    if not prompt.strip():
      raise PromptError(f"{at}empty prompt")
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
    messages = prompt
  else:
    raise PromptError(f"{at}'prompt' must be a non-empty string or message list, found {str(prompt)[:60]!r}")
  if tok.chat_templates:
    text = tok.render_chat(messages, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
  else:
    text = messages[-1]["content"]
    ids = tok.encode(text)
  if len(ids) > max_length:
    raise PromptTooLong(f"{at}prompt has {len(ids)} tokens, more than the allowed {max_length} ({LIMIT})",
                        length=len(ids), limit=max_length)
  return Prompt(index, ids, text, ground_truth_of(record), where)


LIMIT = "sampling.max_prompt_length, bounded by the model's context minus sampling.max_new_tokens"


def check_prompts(source, encode, *, limit: int = 0) -> Tally:
  """Encodes (the first `limit`, 0 = all) prompts of `source` with `encode(record, index=, where=)` before the first
  step: a malformed prompt is a PromptError naming file:line; prompts longer than the sampler allows are one
  PromptError with their count, the longest and the first of them."""
  tally = scan(source, lambda record: encode(record, index=0, where=""), limit=limit, skip_bad_records=None,
               noun="prompts", limit_key="the prompt limit", error=PromptError)
  if tally.too_long:
    raise PromptError(f"{getattr(source, 'path', 'prompts')}: {tally.summary()}; the prompt limit is {LIMIT}: "
                      "raise it or shorten the prompts")
  return tally


def left_pad(prompts: list[Prompt], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompt ids and mask [B, P], left-padded to the sampler's bucket (`sampling.prompt_bucket`)."""
  return left_pad_ids([p.ids for p in prompts], pad_id)


def left_pad_ids(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Token-id rows -> ids and mask [B, P], left-padded to the sampler's bucket."""
  width = sampling.prompt_bucket(max(len(r) for r in rows))
  ids = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    ids[i, width - len(r):] = r
    mask[i, width - len(r):] = 1
  return ids, mask
