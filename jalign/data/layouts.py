"""Datasets as they come -> the records jalign's encoders read (TRL's layouts, plus `ground_truth`).

The encoders read TRL's layouts: `messages`; `prompt` + `completion`; `prompt` + `chosen` + `rejected` (or whole
conversations in `chosen`/`rejected`); `prompt` + `completion` + `label` (KTO); and verl's prompt records
(`prompt` + `answer` / `ground_truth` / `reward_model.ground_truth`). Other common datasets are mapped onto them:

| layout          | recognised by                                        | becomes                                         |
| --------------- | ---------------------------------------------------- | ----------------------------------------------- |
| `gsm8k`         | `question` + `answer` ending in `#### <number>`      | user prompt, assistant completion, ground truth |
|                 |                                                      | = the number after `####`                       |
| `math`          | `problem` + `solution` with `\\boxed{...}`           | same; ground truth = the last boxed answer      |
| `hh_rlhf`       | `chosen`/`rejected` transcripts "\\n\\nHuman: ..."   | shared prompt messages, chosen/rejected replies |
| `ultrafeedback` | `prompt` string + `chosen`/`rejected` message lists  | whole conversations; `score_*` -> `*_score`     |
| `sharegpt`      | `conversations` of `{from, value}` (LLaMA-Factory)   | messages; `chosen`/`rejected` turns -> a pair   |
| `kto_messages`  | `messages` + boolean `label` (LLaMA-Factory KTO)     | prompt messages + the last turn as completion   |

`layout="auto"` maps a record only when it lacks the fields the TRL layouts need, so TRL and verl records pass
through unchanged; a named layout is applied to every record. `prompt_key` / `answer_key` (verl's
`data.prompt_key`, `reward_model.ground_truth`) name the prompt and ground-truth fields of any other dataset.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from jalign.core.errors import DataError
from jalign.data.answers import extract_boxed, extract_gsm8k


def gsm8k_answer(solution: str) -> str | None:
  """The number after the last `####` of a GSM8K solution (GSM8K's answer convention), commas removed."""
  found = extract_gsm8k(solution)
  return found.replace(",", "") if found else None


# ------------------------------------------------------------------------------------------------ layouts


def _user(text) -> list[dict]:
  return [{"role": "user", "content": text}]


def _assistant(text) -> list[dict]:
  return [{"role": "assistant", "content": text}]


def _gsm8k(r: dict) -> dict:
  truth = gsm8k_answer(str(r["answer"]))
  if truth is None:
    raise DataError("GSM8K record: 'answer' has no '#### <number>' line to take the ground truth from")
  return {"prompt": _user(r["question"]), "completion": _assistant(r["answer"]), "ground_truth": truth}


def _math(r: dict) -> dict:
  truth = r.get("answer") or extract_boxed(str(r["solution"]))
  if truth is None:
    raise DataError("MATH record: 'solution' has no \\boxed{...} answer and there is no 'answer' field")
  return {"prompt": _user(r["problem"]), "completion": _assistant(r["solution"]), "ground_truth": str(truth)}


# a few HH-RLHF transcripts spell a turn "Humans:"; read as "Human:" so the turn is not glued to the reply before it
_HH_TURN = re.compile(r"\n\n(Humans?|Assistant):")
_HH_ROLES = {"Human": "user", "Humans": "user", "Assistant": "assistant"}


def hh_messages(transcript: str, key: str) -> list[dict]:
  """'\\n\\nHuman: ...\\n\\nAssistant: ...' -> messages (Anthropic HH-RLHF's transcript form)."""
  parts = _HH_TURN.split(transcript)
  if parts[0].strip() or len(parts) < 3:
    raise DataError(f"field {key!r} is not an HH-RLHF transcript (turns start with '\\n\\nHuman:' / "
                    "'\\n\\nAssistant:')")
  return [{"role": _HH_ROLES[role], "content": text.strip()} for role, text in zip(parts[1::2], parts[2::2])]


def split_shared_prompt(chosen: list[dict], rejected: list[dict], *, end_at_user: bool = True
                        ) -> tuple[list, list, list]:
  """The messages both conversations share (TRL's implicit prompt), backed up to end at a user turn unless
  `end_at_user` is False (TRL's own rule); then each side's own messages."""
  k = 0
  while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
    k += 1
  while end_at_user and k and chosen[k - 1]["role"] != "user":
    k -= 1
  if k == 0:
    raise DataError("'chosen' and 'rejected' share no leading messages" + (" ending in a user turn" if end_at_user
                    else "") + ", so there is no prompt to condition both on (and no 'prompt' field)")
  return chosen[:k], chosen[k:], rejected[k:]


def _hh_rlhf(r: dict) -> dict:
  prompt, chosen, rejected = split_shared_prompt(hh_messages(r["chosen"], "chosen"),
                                                 hh_messages(r["rejected"], "rejected"))
  return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _ultrafeedback(r: dict) -> dict:
  out = {"chosen": r["chosen"], "rejected": r["rejected"]}
  for theirs, ours in (("score_chosen", "chosen_score"), ("score_rejected", "rejected_score")):
    if theirs in r:
      out[ours] = r[theirs]
  return out


_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "system": "system"}


def _sharegpt_turn(m, key: str) -> dict:
  if not isinstance(m, dict) or m.get("from") not in _SHAREGPT_ROLES or not isinstance(m.get("value"), str):
    raise DataError(f"{key}: a ShareGPT turn needs 'from' (one of {', '.join(_SHAREGPT_ROLES)}) and a string "
                    f"'value', found {str(m)[:80]!r}")
  return {"role": _SHAREGPT_ROLES[m["from"]], "content": m["value"]}


def _sharegpt(r: dict) -> dict:
  turns = r["conversations"]
  if not isinstance(turns, list) or not turns:
    raise DataError("field 'conversations' must be a non-empty list of {from, value} turns")
  messages = [_sharegpt_turn(m, f"conversations[{i}]") for i, m in enumerate(turns)]
  if "system" in r and isinstance(r["system"], str) and r["system"].strip():
    messages = [{"role": "system", "content": r["system"]}] + messages
  if "chosen" not in r and "rejected" not in r:
    return {"messages": messages}
  sides = [r.get(k) for k in ("chosen", "rejected")]
  return {"prompt": messages, **{k: [_sharegpt_turn(v, k)] if isinstance(v, dict) else
                                 [_sharegpt_turn(m, k) for m in (v or [None])]
                                 for k, v in zip(("chosen", "rejected"), sides)}}


def _kto_messages(r: dict) -> dict:
  messages = r["messages"]
  if not isinstance(messages, list) or len(messages) < 2:
    raise DataError("field 'messages' must hold the prompt turns and the completion as its last turn")
  return {"prompt": messages[:-1], "completion": messages[-1:], "label": r["label"]}


@dataclasses.dataclass(frozen=True)
class Layout:
  detect: Callable[[dict], bool]       # recognised under layout="auto" (only when TRL's fields are absent)
  convert: Callable[[dict], dict]
  fields: tuple[str, ...]              # fields a record must have under this named layout


def _is_hh(r: dict) -> bool:
  return all(isinstance(r.get(k), str) and r[k].lstrip(" ").startswith("\n\nHuman:") for k in ("chosen", "rejected"))


def _is_messages(v) -> bool:
  return isinstance(v, list) and bool(v) and all(isinstance(m, dict) and "role" in m for m in v)


LAYOUTS: dict[str, Layout] = {
    "gsm8k": Layout(lambda r: "question" in r and "####" in str(r.get("answer", "")) and "prompt" not in r,
                    _gsm8k, ("question", "answer")),
    "math": Layout(lambda r: "problem" in r and "solution" in r and "prompt" not in r, _math,
                   ("problem", "solution")),
    "hh_rlhf": Layout(lambda r: "prompt" not in r and _is_hh(r), _hh_rlhf, ("chosen", "rejected")),
    "ultrafeedback": Layout(lambda r: isinstance(r.get("prompt"), str) and _is_messages(r.get("chosen"))
                            and _is_messages(r.get("rejected")), _ultrafeedback, ("chosen", "rejected")),
    "sharegpt": Layout(lambda r: "conversations" in r and "messages" not in r and "prompt" not in r, _sharegpt,
                       ("conversations",)),
    "kto_messages": Layout(lambda r: _is_messages(r.get("messages")) and isinstance(r.get("label"), bool)
                           and "prompt" not in r, _kto_messages, ("messages", "label")),
}
NAMES = ("auto", "none", *LAYOUTS)


@dataclasses.dataclass(frozen=True)
class Fields:
  """How records of a dataset map onto jalign's layouts (config `data.layout`, `data.prompt_key`,
  `data.answer_key`)."""
  layout: str = "auto"                 # "auto", "none" (records used as they are) or a name of LAYOUTS
  prompt_key: str = ""                 # field holding the prompt (string or messages); "" = by layout
  answer_key: str = ""                 # field holding the ground truth; "" = by layout
  prompt_suffix: str = ""              # appended to the prompt (its last user turn): the answer format a verifier
                                       # reads, as verl's GSM8K / MATH preprocessing appends it

  def __post_init__(self):
    if self.layout not in NAMES:
      raise DataError(f"data layout {self.layout!r}: accepted: {', '.join(NAMES)}")

  def __call__(self, record) -> dict:
    """The record in a layout the encoders read; DataError naming the layout and what is missing."""
    if not isinstance(record, dict):
      raise DataError(f"expected a JSON object, found {type(record).__name__}")
    out = self._mapped(record)
    return self._suffixed(out) if self.prompt_suffix and "prompt" in out else out

  def _mapped(self, record: dict) -> dict:
    if self.prompt_key or self.answer_key:
      return self._keyed(record)
    if self.layout == "none":
      return record
    if self.layout == "auto":
      name = next((n for n, lay in LAYOUTS.items() if lay.detect(record)), None)
      return record if name is None else LAYOUTS[name].convert(record)
    lay = LAYOUTS[self.layout]
    missing = [k for k in lay.fields if k not in record]
    if missing:
      raise DataError(f"data layout {self.layout!r} needs field(s) {missing}; this record has {sorted(record)}")
    return lay.convert(record)

  def _suffixed(self, record: dict) -> dict:
    prompt = record["prompt"]
    if isinstance(prompt, str):
      return {**record, "prompt": prompt + self.prompt_suffix}
    last = max((i for i, m in enumerate(prompt) if isinstance(m, dict) and m.get("role") == "user"), default=None)
    if last is None:
      raise DataError("data.prompt_suffix: the prompt has no user turn to append it to")
    turn = {**prompt[last], "content": prompt[last]["content"] + self.prompt_suffix}
    return {**record, "prompt": prompt[:last] + [turn] + prompt[last + 1:]}

  def _keyed(self, record: dict) -> dict:
    out = dict(record)
    for key, ours in ((self.prompt_key, "prompt"), (self.answer_key, "ground_truth")):
      if not key:
        continue
      value = record
      for part in key.split("."):             # verl's nested `reward_model.ground_truth`
        if not isinstance(value, dict) or part not in value:
          raise DataError(f"field {key!r} (data.{'prompt_key' if ours == 'prompt' else 'answer_key'}) not in "
                          f"this record; it has {sorted(record)}")
        value = value[part]
      out[ours] = value
    if self.answer_key:
      out.pop("answer", None)                 # the named field is the ground truth, not a stray `answer`
      truth = str(out["ground_truth"])
      out["ground_truth"] = gsm8k_answer(truth) or extract_boxed(truth) or truth
    return out


class MappedSource:
  """A record source whose records pass through `fields`; errors name the record's place in its file."""

  def __init__(self, source, fields: Fields):
    self.source, self.fields = source, fields
    self.path = getattr(source, "path", "<data>")

  def __len__(self) -> int:
    return len(self.source)

  def where(self, i: int) -> str:
    return self.source.where(i)

  def __getitem__(self, i: int) -> dict:
    record = self.source[i]
    try:
      return self.fields(record)
    except DataError as e:
      raise DataError(f"{self.where(i)}: {e}") from None
