"""Preference pairs -> token ids: chosen and rejected encoded against the same prompt, batched together.

Accepted records (TRL's two styles; one style per dataset):
- plain: `{"prompt": str, "chosen": str, "rejected": str}`: prompt encoded with the tokenizer's special tokens, each
  completion appended with eos;
- conversational: `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}` rendered with the chat
  template (loss on the completion messages, end-of-turn included), or TRL's implicit-prompt form without `prompt`,
  where `chosen`/`rejected` are whole conversations sharing every message but the last.
Optional per-pair fields: `margin` (Bradley-Terry margin), `chosen_score`/`rejected_score` (gold scores for
reward-model evaluation), `ref_chosen_logps`/`ref_rejected_logps` (precomputed reference log-probs for DPO; TRL's
column names).

A batch holds whole pairs: `tokens`, `loss_mask`, `segment_ids`, `positions` are int32 [B, 2, L] (index 0 =
chosen, 1 = rejected), so data parallelism and gradient accumulation never split a pair.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable

import numpy as np

from jalign.data.layouts import split_shared_prompt
from jalign.data.scan import Tally, scan
from jalign.data.sft import (
  TooLong,
  _check_messages,
  _check_text,
  _template_spans,
  _tokens_with_mask,
)
from jalign.data.sources import DataError
from jalign.sampling import prompt_bucket
from jalign.tokenizers.tokenizer import ChatTemplateError, Tokenizer

OPTIONAL_FLOATS = ("margin", "chosen_score", "rejected_score", "ref_chosen_logps", "ref_rejected_logps")
STYLES = ("plain", "conversational")


def style_of(record) -> str:
  """'plain' or 'conversational'; DataError naming what is wrong with a record that is neither."""
  if not isinstance(record, dict):
    raise DataError(f"expected an object, found {type(record).__name__}")
  for key in ("chosen", "rejected"):
    if key not in record:
      raise DataError(f"record has no {key!r} field (keys: {sorted(record)}); a preference record needs "
                      "'chosen' and 'rejected' (and 'prompt' unless they are whole conversations)")
  kinds = {k: "conversational" if isinstance(record[k], list) else "plain"
           for k in ("prompt", "chosen", "rejected") if k in record}
  if len(set(kinds.values())) > 1:
    raise DataError(f"record mixes plain text and message lists: {kinds}")
  style = next(iter(kinds.values()))
  if style == "plain" and "prompt" not in record:
    raise DataError("plain-text record has no 'prompt' field")
  return style


def _encode_side(tok: Tokenizer, style: str, prompt, completion, key: str) -> tuple[np.ndarray, np.ndarray]:
  if style == "conversational":
    messages = prompt + _check_messages(completion, key)
    for i, m in enumerate(completion):
      if m["role"] == "assistant" and not m["content"].strip():
        raise DataError(f"{key}[{i}] (assistant) has empty content")
    text, spans = _template_spans(tok, messages, len(prompt))
    ids, mask = _tokens_with_mask(tok, text, spans)
  else:
    p = tok.encode(prompt, add_special_tokens=True)
    c = tok.encode(_check_text(completion, key), add_special_tokens=False)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    ids = np.asarray(p + c + eos, np.int32)
    mask = np.asarray([0] * len(p) + [1] * (len(c) + len(eos)), np.int32)
  if not mask.any():
    raise DataError(f"{key!r} has no completion tokens")
  return ids, mask


def _prompt_length(mask: np.ndarray) -> int:
  return int(np.argmax(mask > 0))


def encode(record: dict, tok: Tokenizer, *, max_length: int, truncation: str = "keep_start") -> dict:
  """{"chosen", "chosen_mask", "rejected", "rejected_mask": int32[n <= max_length], plus the optional float
  fields present in the record}; raises DataError on a malformed record, TooLong when truncation='drop'."""
  style = style_of(record)
  try:
    if style == "conversational":
      if "prompt" in record:
        prompt = _check_messages(record["prompt"], "prompt")
        chosen, rejected = record["chosen"], record["rejected"]
      else:
        prompt, chosen, rejected = split_shared_prompt(_check_messages(record["chosen"], "chosen"),
                                                       _check_messages(record["rejected"], "rejected"),
                                                       end_at_user=False)   # TRL's implicit prompt
    else:
      prompt, chosen, rejected = _check_text(record["prompt"], "prompt"), record["chosen"], record["rejected"]
    sides = [_encode_side(tok, style, prompt, chosen, "chosen"),
             _encode_side(tok, style, prompt, rejected, "rejected")]
  except ChatTemplateError as e:
    raise DataError(str(e)) from None
  prompt_len = _prompt_length(sides[0][1])
  longest = max(len(ids) for ids, _ in sides)
  if prompt_len >= max_length or (longest > max_length and truncation == "drop"):
    what = (f"prompt has {prompt_len} tokens, not fewer than max_length={max_length}" if prompt_len >= max_length
            else f"{longest} tokens, more than max_length={max_length} (truncation='drop')")
    if truncation == "drop":
      raise TooLong(what, length=prompt_len if prompt_len >= max_length else longest, limit=max_length)
    raise DataError(what + "; raise data.max_length, shorten the prompt or set data.truncation='drop' to skip")
  if longest > max_length:
    if truncation == "keep_start":  # cut the completions' ends
      sides = [(ids[:max_length], mask[:max_length]) for ids, mask in sides]
    else:  # keep_end: cut the same number of prompt tokens from the start of both, keeping the completions whole
      cut = longest - max_length
      if cut >= prompt_len:
        raise DataError(f"a completion alone is longer than max_length={max_length}; truncation='keep_end' "
                        "would remove the whole prompt")
      sides = [(ids[cut:], mask[cut:]) for ids, mask in sides]
  out = {"chosen": sides[0][0], "chosen_mask": sides[0][1], "rejected": sides[1][0], "rejected_mask": sides[1][1]}
  for key in OPTIONAL_FLOATS:
    if record.get(key) is not None:
      value = record[key]
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"field {key!r} must be a finite number, found {value!r:.40}")
      out[key] = float(value)
  return out


def pair_batch(buckets: tuple[int, ...], *, optional: tuple[str, ...] = OPTIONAL_FLOATS) -> Callable:
  """Batches pairs right-padded to the smallest bucket that fits the longest sequence of the batch. Missing
  optional fields become NaN (margin: 0)."""
  def batch(examples: list[dict]) -> dict:
    longest = max(max(len(e["chosen"]), len(e["rejected"])) for e in examples)
    length = next((b for b in buckets if b >= longest), buckets[-1])
    def pad(x):
      return np.pad(x, (0, length - len(x)))
    tokens = np.stack([np.stack([pad(e["chosen"]), pad(e["rejected"])]) for e in examples]).astype(np.int32)
    mask = np.stack([np.stack([pad(e["chosen_mask"]), pad(e["rejected_mask"])]) for e in examples]).astype(np.int32)
    real = np.stack([np.stack([pad(np.ones_like(e["chosen"])), pad(np.ones_like(e["rejected"]))])
                     for e in examples]).astype(np.int32)
    out = {"tokens": tokens, "loss_mask": mask, "segment_ids": real,
           "positions": np.where(real > 0, np.arange(length), 0).astype(np.int32)}
    out.update(_optional_fields(examples, optional))
    return out
  return batch


def _optional_fields(examples: list[dict], optional: tuple[str, ...]) -> dict:
  return {key: np.asarray([e.get(key, 0.0 if key == "margin" else np.nan) for e in examples], np.float32)
          for key in optional}


def shared_prompt_length(example: dict) -> int:
  """Tokens both sides of an encoded pair share before either side's first loss token."""
  c, r = example["chosen"], example["rejected"]
  n = min(_prompt_length(example["chosen_mask"]), _prompt_length(example["rejected_mask"]))
  differ = np.flatnonzero(c[:n] != r[:n])
  return int(differ[0]) if differ.size else n


def split_width(n: int) -> int:
  """Columns for a prompt or completion part of `n` tokens: four widths per doubling, at least 8."""
  return prompt_bucket(n, minimum=8)


def split_pair_batch(examples: list[dict], *, optional: tuple[str, ...] = OPTIONAL_FLOATS) -> dict:
  """Pairs in the split layout, for running each prompt once per pair. Every row is the pair's shared prompt (the
  tokens both sides share before either's first loss token) left-padded to P columns, then that side's completion
  right-padded to C; P and C are the batch's longest, rounded up by `split_width`. `prompt_mask` [B, P] (1 = prompt
  token) marks the layout and gives P. The rows are still ordinary padded sequences (`segment_ids` 0 on padding,
  true `positions`), so any consumer may ignore the split. Missing optional fields as in `pair_batch`."""
  shared = [shared_prompt_length(e) for e in examples]
  if min(shared) == 0:
    raise DataError("a pair whose chosen and rejected share no first token cannot share its prompt; set "
                    "dpo.share_prompt=False (rm.share_prompt=False for a reward model)")
  sides = [[(e[k][p:], e[k + "_mask"][p:]) for k in ("chosen", "rejected")] for e, p in zip(examples, shared)]
  pw, cw = split_width(max(shared)), split_width(max(len(ids) for pair in sides for ids, _ in pair))
  b = len(examples)
  tokens, loss_mask, real = (np.zeros((b, 2, pw + cw), np.int32) for _ in range(3))
  positions = np.zeros((b, 2, pw + cw), np.int32)
  for i, (e, p, pair) in enumerate(zip(examples, shared, sides)):
    tokens[i, :, pw - p:pw] = e["chosen"][:p]
    real[i, :, pw - p:pw] = 1
    positions[i, :, pw - p:pw] = np.arange(p)
    for s, (ids, mask) in enumerate(pair):
      n = len(ids)
      tokens[i, s, pw:pw + n], loss_mask[i, s, pw:pw + n], real[i, s, pw:pw + n] = ids, mask, 1
      positions[i, s, pw:pw + n] = p + np.arange(n)
  out = {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": real, "positions": positions,
         "prompt_mask": real[:, 0, :pw].copy()}
  out.update(_optional_fields(examples, optional))
  return out


def widen_split(batch: dict, prompt_width: int, completion_width: int) -> dict:
  """A split-layout batch padded out to wider prompt (on the left) and completion (on the right) parts, so that
  processes whose local batches came out narrower agree on one global shape."""
  pw = batch["prompt_mask"].shape[1]
  cw = batch["tokens"].shape[2] - pw
  if (pw, cw) == (prompt_width, completion_width):
    return batch
  pad = ((0, 0), (0, 0), (prompt_width - pw, completion_width - cw))
  out = {k: np.pad(batch[k], pad) for k in ("tokens", "loss_mask", "segment_ids", "positions")}
  out["prompt_mask"] = np.pad(batch["prompt_mask"], ((0, 0), (prompt_width - pw, 0)))
  return {**batch, **out}


# ------------------------------------------------------------------------------------------ checks before training

@dataclasses.dataclass
class PairStats:
  pairs: int = 0
  identical: int = 0                # chosen == rejected
  duplicated_prompts: int = 0       # pairs whose prompt appeared in an earlier pair
  most_pairs_per_prompt: int = 0
  chosen_tokens_mean: float = 0.0
  rejected_tokens_mean: float = 0.0
  has_gold: bool = False
  has_ref_logps: bool = False

  @property
  def length_ratio(self) -> float:
    return self.chosen_tokens_mean / max(self.rejected_tokens_mean, 1e-9)

  def problems(self, max_length_ratio: float, pairs_per_prompt: int = 1) -> list[str]:
    """What the checks found; a prompt may have up to `pairs_per_prompt` pairs (several rejected answers to one
    question) before its repeats are reported."""
    out = []
    if self.identical:
      out.append(f"{self.identical} pairs have chosen identical to rejected (no preference signal)")
    if self.most_pairs_per_prompt > pairs_per_prompt:
      out.append(f"{self.duplicated_prompts} pairs repeat an earlier pair's prompt (up to "
                 f"{self.most_pairs_per_prompt} pairs per prompt; data.pairs_per_prompt={pairs_per_prompt})")
    r = self.length_ratio
    if r > max_length_ratio or r < 1 / max_length_ratio:
      out.append(f"chosen/rejected length ratio {r:.2f} (chosen {self.chosen_tokens_mean:.1f} vs rejected "
                 f"{self.rejected_tokens_mean:.1f} tokens on average) is outside [1/{max_length_ratio:g}, "
                 f"{max_length_ratio:g}]: a model can learn length instead of quality")
    return out

  def summary(self) -> str:
    return (f"over the {self.pairs} kept pairs: chosen {self.chosen_tokens_mean:.1f} / rejected {self.rejected_tokens_mean:.1f} "
            f"tokens on average (ratio {self.length_ratio:.2f}); {self.identical} identical pairs; "
            f"{self.duplicated_prompts} repeated prompts")


def check_pairs(source, encode_fn: Callable[[dict], dict], *, limit: int = 0, skip_bad_records: bool = False
                ) -> tuple[PairStats, Tally]:
  """Reads (the first `limit` or all) records once (`data.scan`): one style per dataset, every record encodable
  (else DataError naming file:line, unless skip_bad_records), and the statistics of `PairStats` over the kept
  pairs."""
  stats = PairStats()
  first_style: list[tuple[str, str]] = []
  prompts: collections.Counter = collections.Counter()
  sums = collections.Counter()

  def encode(record):
    style = style_of(record)
    if first_style and style != first_style[0][0]:
      raise DataError(f"{style} record in a dataset whose first record ({first_style[0][1]}) is "
                      f"{first_style[0][0]}; use one style per dataset")
    return encode_fn(record)

  def kept(i, record, ex):
    if not first_style:
      first_style.append((style_of(record), source.where(i)))
    stats.identical += int(np.array_equal(ex["chosen"], ex["rejected"]))
    prompt_key = repr(record.get("prompt")) if "prompt" in record else repr(ex["chosen"][:_prompt_length(
        ex["chosen_mask"])].tolist())
    prompts[prompt_key] += 1
    sums.update(chosen=int(ex["chosen_mask"].sum()), rejected=int(ex["rejected_mask"].sum()),
                gold="chosen_score" in ex and "rejected_score" in ex,
                ref="ref_chosen_logps" in ex and "ref_rejected_logps" in ex)

  tally = scan(source, encode, limit=limit, skip_bad_records=skip_bad_records, noun="preference pairs", on_kept=kept)
  stats.pairs = tally.kept
  stats.duplicated_prompts = sum(c - 1 for c in prompts.values())
  stats.most_pairs_per_prompt = max(prompts.values())
  stats.chosen_tokens_mean = sums["chosen"] / stats.pairs
  stats.rejected_tokens_mean = sums["rejected"] / stats.pairs
  stats.has_gold = sums["gold"] == stats.pairs
  stats.has_ref_logps = sums["ref"] == stats.pairs
  return stats, tally


# ------------------------------------------------------------------------------------------ unpaired (KTO)

def encode_unpaired(record: dict, tok: Tokenizer, *, max_length: int, truncation: str = "keep_start") -> dict:
  """KTO examples of one record: an unpaired `{"prompt", "completion", "label": bool}` (TRL's layout; plain or
  conversational) gives one, a preference pair gives two (chosen desirable, rejected undesirable).
  Returns {"examples": [(prompt_ids, completion_ids, completion_mask, label), ...]}."""
  if not isinstance(record, dict):
    raise DataError(f"expected an object, found {type(record).__name__}")
  if "chosen" in record or "rejected" in record:
    ex = encode(record, tok, max_length=max_length, truncation=truncation)
    out = []
    for side, label in (("chosen", 1.0), ("rejected", 0.0)):
      ids, mask = ex[side], ex[side + "_mask"]
      plen = _prompt_length(mask)
      out.append((ids[:plen], ids[plen:], mask[plen:], label))
    return {"examples": out}
  for key in ("prompt", "completion", "label"):
    if key not in record:
      raise DataError(f"record has no {key!r} field (keys: {sorted(record)}); KTO needs 'prompt', 'completion' and "
                      "a boolean 'label', or a preference pair")
  if not isinstance(record["label"], bool):
    raise DataError(f"field 'label' must be true or false, found {record['label']!r:.40}")
  prompt, completion = record["prompt"], record["completion"]
  if isinstance(prompt, list) != isinstance(completion, list):
    raise DataError("record mixes plain text and message lists")
  style = "conversational" if isinstance(prompt, list) else "plain"
  try:
    prompt = _check_messages(prompt, "prompt") if style == "conversational" else _check_text(prompt, "prompt")
    ids, mask = _encode_side(tok, style, prompt, completion, "completion")
  except ChatTemplateError as e:
    raise DataError(str(e)) from None
  plen = _prompt_length(mask)
  if plen >= max_length:
    if truncation == "drop":
      raise TooLong(f"prompt has {plen} tokens, not fewer than max_length={max_length}", length=plen,
                    limit=max_length)
    raise DataError(f"prompt has {plen} tokens, not fewer than max_length={max_length}")
  if len(ids) > max_length:
    if truncation == "drop":
      raise TooLong(f"{len(ids)} tokens, more than max_length={max_length} (truncation='drop')", length=len(ids),
                    limit=max_length)
    if truncation == "keep_start":
      ids, mask = ids[:max_length], mask[:max_length]
    else:
      cut = len(ids) - max_length
      if cut >= plen:
        raise DataError(f"the completion alone is longer than max_length={max_length}")
      ids, mask, plen = ids[cut:], mask[cut:], plen - cut
  return {"examples": [(ids[:plen], ids[plen:], mask[plen:], 1.0 if record["label"] else 0.0)]}


def kto_batch(buckets: tuple[int, ...]) -> Callable:
  """Flattens the records' examples into N rows laid out [N, 2, L]: index 0 = prompt_j + completion_j, index 1 =
  the KL sequence prompt_j + completion_{j-k} (k = examples per record, so a pair's two completions never meet
  their own prompt): TRL's mismatched pairs for KTO's batch KL estimate. Sequences longer than the largest bucket
  (only KL sequences can be) are cut there."""
  def batch(records: list[dict]) -> dict:
    rows = [e for r in records for e in r["examples"]]
    k = len(records[0]["examples"])
    n = len(rows)
    seqs = []
    for j, (p, c, m, _) in enumerate(rows):
      _, kc, km, _ = rows[(j - k) % n]
      seqs.append([(np.concatenate([p, c]), np.concatenate([np.zeros_like(p), m])),
                   (np.concatenate([p, kc]), np.concatenate([np.zeros_like(p), km]))])
    longest = max(len(ids) for pair in seqs for ids, _ in pair)
    length = next((b for b in buckets if b >= longest), buckets[-1])
    def pad(x):
      x = x[:length]
      return np.pad(x, (0, length - len(x)))
    tokens = np.asarray([[pad(ids) for ids, _ in pair] for pair in seqs], np.int32)
    mask = np.asarray([[pad(m) for _, m in pair] for pair in seqs], np.int32)
    real = np.asarray([[pad(np.ones_like(ids)) for ids, _ in pair] for pair in seqs], np.int32)
    nan = np.full(n, np.nan, np.float32)
    return {"tokens": tokens, "loss_mask": mask, "segment_ids": real,
            "positions": np.where(real > 0, np.arange(length), 0).astype(np.int32),
            "label": np.asarray([r[3] for r in rows], np.float32), "ref_logps": nan, "ref_kl_logps": nan.copy()}
  return batch


def check_unpaired(source, encode_fn: Callable[[dict], dict], *, limit: int = 0, skip_bad_records: bool = False
                   ) -> tuple[int, int, Tally]:
  """(desirable, undesirable) example counts of the kept records and the tally (`data.scan`); DataError naming
  file:line for a bad record (unless skipped) or when records give different numbers of examples (pairs and
  unpaired records mixed in one dataset)."""
  counts = [0, 0]
  per_record: list[tuple[int, str]] = []

  def kept(i, record, ex):
    examples = ex["examples"]
    if not per_record:
      per_record.append((len(examples), source.where(i)))
    elif len(examples) != per_record[0][0]:
      first = per_record[0]
      raise DataError(f"{source.where(i)}: {'a preference pair' if len(examples) == 2 else 'an unpaired record'} "
                      f"in a dataset whose first record ({first[1]}) is {'a pair' if first[0] == 2 else 'unpaired'}; "
                      "use one layout per dataset")
    for e in examples:
      counts[0 if e[3] else 1] += 1

  tally = scan(source, encode_fn, limit=limit, skip_bad_records=skip_bad_records, on_kept=kept)
  return counts[0], counts[1], tally
