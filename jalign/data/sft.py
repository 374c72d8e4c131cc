"""SFT records -> token ids with a loss mask on assistant / completion tokens only.

Accepted records (TRL's layouts): `{"messages": [{"role", "content"}, ...]}` (loss on every assistant turn, including
its end-of-turn token), or `{"prompt", "completion"}` as strings (plain concatenation, loss on the completion and
eos) or as message lists (chat template; loss on the completion messages). A record's `tools` (a list of JSON
schemas, TRL's column) goes to the chat template's tool section.
"""
from __future__ import annotations

import numpy as np

from jalign.data.sources import DataError
from jalign.tokenizers.tokenizer import ChatTemplateError, Tokenizer

TRUNCATION = ("keep_start", "keep_end", "drop")


class TooLong(DataError):
  """A record longer than max_length under truncation='drop': always skipped and counted, never fatal. `length` is
  the record's token count (its prompt's, when the prompt alone does not fit), `limit` the limit it exceeds."""

  def __init__(self, message: str, *, length: int, limit: int):
    super().__init__(message)
    self.length, self.limit = length, limit


def _check_messages(messages, key: str) -> list[dict]:
  if not isinstance(messages, list) or not messages:
    raise DataError(f"field {key!r} must be a non-empty list of messages, found {type(messages).__name__}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise DataError(f"{key}[{i}] must be an object with string 'role' and 'content', found {str(m)[:80]!r}")
  return messages


def _check_text(value, key: str) -> str:
  if not isinstance(value, str):
    raise DataError(f"field {key!r} must be a string or a message list, found {type(value).__name__}")
  if not value.strip():
    raise DataError(f"field {key!r} is empty")
  return value


def _template_spans(tok: Tokenizer, messages: list[dict], trained_from: int,
                    **render_kwargs) -> tuple[str, list[tuple[int, int]]]:
  """Rendered text and the character spans of assistant messages from index `trained_from` on.

  A span runs from the end of the conversation rendered up to the message with the generation prompt, to the end of
  the conversation rendered through the message (so the end-of-turn token is learned)."""
  render = lambda m, **kw: tok.render_chat(m, **render_kwargs, **kw)  # noqa: E731
  text = render(messages)
  spans = []
  for i, m in enumerate(messages):
    if m["role"] != "assistant" or i < trained_from:
      continue
    before = render(messages[:i], add_generation_prompt=True) if i else ""
    through = render(messages[: i + 1])
    if not text.startswith(through) or not through.startswith(before):
      raise DataError("the chat template does not render conversations incrementally (a prefix of the "
                      "conversation renders differently), so assistant tokens cannot be located")
    spans.append((len(before), len(through)))
  return text, spans


def _tokens_with_mask(tok: Tokenizer, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
  enc = tok.tk.encode(text, add_special_tokens=False)
  ids = np.asarray(enc.ids, np.int32)
  mask = np.zeros(len(ids), np.int32)
  for k, (start, end) in enumerate(enc.offsets):
    mask[k] = any(start < e and end > s for s, e in spans)
  return ids, mask


def encode(record: dict, tok: Tokenizer, *, max_length: int, truncation: str = "keep_start") -> dict:
  """{"tokens": int32[n], "loss_mask": int32[n]} with n <= max_length; raises DataError on a malformed record."""
  if not isinstance(record, dict):
    raise DataError(f"expected an object, found {type(record).__name__}")
  tools = record.get("tools")
  if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
    raise DataError(f"field 'tools' must be a list of JSON schema objects, found {str(tools)[:80]!r}")
  kwargs = {"tools": tools} if tools else {}
  try:
    if "messages" in record:
      messages = _check_messages(record["messages"], "messages")
      if not any(m["role"] == "assistant" for m in messages):
        raise DataError("'messages' has no assistant turn to learn from")
      for i, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
          raise DataError(f"messages[{i}] (assistant) has empty content")
      text, spans = _template_spans(tok, messages, 0, **kwargs)
      ids, mask = _tokens_with_mask(tok, text, spans)
    elif "prompt" in record and "completion" in record:
      prompt, completion = record["prompt"], record["completion"]
      if isinstance(prompt, list) or isinstance(completion, list):
        messages = _check_messages(prompt, "prompt") + _check_messages(completion, "completion")
        text, spans = _template_spans(tok, messages, len(prompt), **kwargs)
        ids, mask = _tokens_with_mask(tok, text, spans)
      else:
        p = tok.encode(_check_text(prompt, "prompt"), add_special_tokens=True)
        c = tok.encode(_check_text(completion, "completion"), add_special_tokens=False)
        eos = [] if tok.eos_id is None else [tok.eos_id]
        ids = np.asarray(p + c + eos, np.int32)
        mask = np.asarray([0] * len(p) + [1] * (len(c) + len(eos)), np.int32)
    else:
      raise DataError(f"record has neither 'messages' nor 'prompt'+'completion' (keys: {sorted(record)})")
  except ChatTemplateError as e:
    raise DataError(str(e)) from None
  if len(ids) > max_length:
    if truncation == "keep_start":
      ids, mask = ids[:max_length], mask[:max_length]
    elif truncation == "keep_end":
      ids, mask = ids[-max_length:], mask[-max_length:]
    else:
      raise TooLong(f"{len(ids)} tokens, more than max_length={max_length} (truncation='drop')",
                    length=len(ids), limit=max_length)
  if not mask.any():
    raise DataError("no completion tokens left to learn from after truncation")
  return {"tokens": ids, "loss_mask": mask}
