"""One rollout batch: prompts -> `sampling.generate` (n per prompt) -> decoded completions -> rewards -> records."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jalign import sampling
from jalign.data.layouts import NAMES
from jalign.errors import UserError
from jalign.rl.rewards import Batch, RewardSpec
from jalign.tokenizer import Tokenizer


class PromptError(UserError):
  """A prompt record that cannot be used; the message names the record."""


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
  if not isinstance(record, dict) or "prompt" not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise PromptError(f"{where}: record has no 'prompt' field (it has {keys}); name the prompt's field with "
                      "data.prompt_key, or a layout with data.layout (accepted: " + ", ".join(NAMES) + ")")
  prompt = record["prompt"]
  if isinstance(prompt, str):
    if not prompt.strip():
      raise PromptError(f"{where}: empty prompt")
    messages = [{"role": "user", "content": prompt}]
  elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt):
    messages = prompt
  else:
    raise PromptError(f"{where}: 'prompt' must be a non-empty string or message list, found {str(prompt)[:60]!r}")
  if tok.chat_templates:
    text = tok.render_chat(messages, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
  else:
    text = messages[-1]["content"]
    ids = tok.encode(text)
  if len(ids) > max_length:
    raise PromptError(f"{where}: prompt has {len(ids)} tokens, more than the allowed {max_length} "
                      "(sampling.max_prompt_length, bounded by the model's context minus max_new_tokens)")
  return Prompt(index, ids, text, ground_truth_of(record), where)


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  num_samples: int = 4


def left_pad(prompts: list[Prompt], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Prompt ids and mask [B, P], left-padded to the sampler's bucket (`sampling.prompt_bucket`)."""
  width = sampling.prompt_bucket(max(len(p.ids) for p in prompts))
  ids = np.full((len(prompts), width), pad_id, np.int32)
  mask = np.zeros((len(prompts), width), np.int32)
  for row, p in enumerate(prompts):
    ids[row, width - len(p.ids):] = p.ids
    mask[row, width - len(p.ids):] = 1
  return ids, mask


def rollout_batch(lm, tok: Tokenizer, prompts: list[Prompt], rng, spec: SamplingSpec, rewards: RewardSpec,
                  policy_id: str, *, mesh=None, rules=None, model_reward=None) -> tuple[list[dict], dict[str, float]]:
  """Records (one per completion, groups consecutive) and batch statistics. `mesh`/`rules`: sampling layout;
  `model_reward`: a `jalign.rl.model_reward.ModelReward` added to the rewards with its weight."""
  ids, mask = left_pad(prompts, tok.pad_id)
  stop = tuple(t for t in (tok.eos_id,) if t is not None)
  out = sampling.generate(lm, ids, mask, rng, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                          top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p, stop_token_ids=stop,
                          num_samples=spec.num_samples, pad_id=tok.pad_id, mesh=mesh, rules=rules)
  tokens, logprobs, lengths, finish = (np.asarray(jax.device_get(x)) for x in
                                       (out.tokens, out.logprobs, out.lengths, out.finish_reason))
  n = spec.num_samples
  completions = [tok.decode(tokens[i, :lengths[i]]) for i in range(len(tokens))]
  owners = [prompts[i // n] for i in range(len(tokens))]
  total, _ = rewards(Batch(completions, [p.ground_truth for p in owners], lengths, [p.where for p in owners]))
  if model_reward is not None:
    n = spec.num_samples
    total = total + model_reward.weight * model_reward(np.repeat(ids, n, 0), np.repeat(mask, n, 0), tokens, lengths)
  records = [dict(prompt_index=p.index, group_id=p.index, sample=i % n, prompt_ids=list(map(int, p.ids)),
                  response_ids=tokens[i, :lengths[i]].astype(int).tolist(),
                  behaviour_logprobs=logprobs[i, :lengths[i]].astype(float).tolist(), reward=float(total[i]),
                  ground_truth=p.ground_truth, finish_reason=int(finish[i]), prompt=p.text, completion=completions[i],
                  policy=policy_id) for i, p in enumerate(owners)]
  stats = {"rollout/reward_mean": float(np.mean(total)), "rollout/response_length_mean": float(np.mean(lengths)),
           "rollout/new_tokens": float(np.sum(lengths)), "rollout/stopped_frac": float(np.mean(finish))}
  return records, stats
