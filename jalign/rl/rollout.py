"""One rollout batch: prompts -> `sampling.generate` (n per prompt) -> decoded completions -> rewards -> records."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jalign import sampling
from jalign.data.prompts import Prompt, left_pad
from jalign.rl.rewards import Batch, RewardSpec
from jalign.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  num_samples: int = 4


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
