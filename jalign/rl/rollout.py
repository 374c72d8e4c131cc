"""The one path from prompts to scored samples and the rows a model reads: `sample` (n per prompt, decoded) ->
`score` (rewards, a reward model's share); `rl.batch.RolloutBatch.of_rows` lays out the rows a model reads. Online
GRPO/PPO, the rollout task that writes a replay buffer (`rollout_batch`) and held-out evaluation all go through it."""
from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from jalign import sampling
from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.data.prompts import Prompt, left_pad
from jalign.models.sharding import to_host, without_fsdp
from jalign.rewards.verifiable import Batch, RewardSpec
from jalign.rl.batch import pad_routes
from jalign.tokenizers.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  """How completions are sampled (the run config's `sampling` section)."""
  max_new_tokens: int = bounded(32, gt=0)  # tokens sampled per completion (per turn in episodes)
  temperature: float = bounded(1.0, ge=0)  # 0 = greedy
  top_k: int = bounded(0, ge=0)           # 0 = off
  # nucleus sampling: the smallest set of tokens holding this probability; 1 = off
  top_p: float = bounded(1.0, gt=0, le=1)
  min_p: float = bounded(0.0, ge=0, lt=1)  # drop tokens below min_p x the most likely one's probability; 0 = off
  num_samples: int = bounded(4, gt=0)     # completions per prompt (a GRPO group)
  max_prompt_length: int = bounded(64, gt=0)  # prompt tokens kept (longer prompts are an error before the first step)
  layout: Literal["training", "no_fsdp"] = "training"  # weight layout while generating (see models.without_fsdp)
  # Continuous batching: cache slots kept full as requests finish (a group at a time, so >= num_samples); 0 = one
  # slot per completion of the batch (all in flight at once). KV memory: slots x (prompt bucket + max_new_tokens).
  slots: int = bounded(0, ge=0)

  def check(self) -> None:
    if 0 < self.slots < self.num_samples:
      raise ConfigError(f"config.sampling.slots={self.slots} cannot hold a group of sampling.num_samples="
                        f"{self.num_samples}; set slots >= num_samples (or 0: one per completion)")

  def rules(self, training_rules):
    """Logical-axis rules for generation: None keeps the training layout."""
    return without_fsdp(training_rules) if self.layout == "no_fsdp" else None


@dataclasses.dataclass
class Samples:
  """Completions of `prompts`, each repeated `n` times in order (prompt i owns rows i*n .. i*n+n-1)."""
  prompts: list[Prompt]
  n: int
  tokens: np.ndarray          # [N, R] token ids, pad after each length
  lengths: np.ndarray         # [N]
  texts: list[str]
  logprobs: np.ndarray        # [N, R] the sampling distribution's log-probs of the tokens
  finish: np.ndarray          # [N] 1 = stopped on a stop token, 0 = ran out of max_new_tokens
  # MoE (`record_routes`): the experts each token went to, [N, P, L, k] over the prompt (left-padded like
  # `prompt_arrays`) and [N, R, L, k] over the response; int16, -1 = none (`sampling.GenerateOutput.routes`)
  prompt_routes: np.ndarray | None = None
  response_routes: np.ndarray | None = None

  def owners(self) -> list[Prompt]:
    return [self.prompts[i // self.n] for i in range(len(self.tokens))]

  def truths(self) -> list:
    return [p.ground_truth for p in self.owners()]

  def prompt_arrays(self, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompt ids and mask [N, P], one row per completion."""
    ids, mask = left_pad(self.prompts, pad_id)
    return np.repeat(ids, self.n, 0), np.repeat(mask, self.n, 0)


def sample(lm, tok: Tokenizer, prompts: list[Prompt], rng, spec: SamplingSection, *, mesh=None,
           rules=None, record_routes: bool = False) -> Samples:
  """`spec.num_samples` completions of each prompt, decoded. `mesh`/`rules`: the sampling layout. `record_routes`
  (an MoE model): the experts every token went to, for routing replay."""
  ids, mask = left_pad(prompts, tok.pad_id)
  stop = tuple(t for t in (tok.eos_id,) if t is not None)
  out = sampling.generate(lm, ids, mask, rng, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature,
                          top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p, stop_token_ids=stop,
                          num_samples=spec.num_samples, pad_id=tok.pad_id, mesh=mesh, rules=rules,
                          slots=spec.slots, record_routes=record_routes)
  tokens, lengths, logprobs, finish = to_host((out.tokens, out.lengths, out.logprobs, out.finish_reason))
  texts = [tok.decode(tokens[i, :lengths[i]]) for i in range(len(tokens))]
  routes = [None, None]
  if record_routes:  # int16: expert ids fit, at half the host memory
    whole = to_host(out.routes).astype(np.int16)
    routes = [whole[:, :ids.shape[1]], whole[:, ids.shape[1]:]]
  return Samples(prompts, spec.num_samples, tokens, lengths, texts, logprobs, finish, *routes)


def concat(parts: list[Samples]) -> Samples:
  """One Samples of several batches' (the same n)."""
  cat = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
  routes = (None, None)
  if parts[0].prompt_routes is not None:
    routes = (pad_routes([p.prompt_routes for p in parts], left=True), cat("response_routes"))
  return Samples([q for p in parts for q in p.prompts], parts[0].n, cat("tokens"), cat("lengths"),
                 [t for p in parts for t in p.texts], cat("logprobs"), cat("finish"), *routes)



def score(samples: Samples, rewards: RewardSpec, *, pad_id: int,
          model_reward=None) -> tuple[np.ndarray, np.ndarray | None]:
  """Rewards [N] and the reward model's (unweighted) share of them (None without one). `model_reward`: a
  `jalign.rewards.learned.ModelReward`, added with its weight."""
  owners = samples.owners()
  scores, _ = rewards(Batch(samples.texts, [p.ground_truth for p in owners], samples.lengths,
                            [p.where for p in owners]))
  rm_scores = None
  if model_reward is not None:
    rm_scores = model_reward(*samples.prompt_arrays(pad_id), samples.tokens, samples.lengths)
    scores = scores + model_reward.weight * rm_scores
  return scores, rm_scores


def rollout_batch(lm, tok: Tokenizer, prompts: list[Prompt], rng, spec: SamplingSection, rewards: RewardSpec,
                  policy_id: str, *, mesh=None, rules=None, model_reward=None) -> tuple[list[dict], dict[str, float]]:
  """Replay-buffer records (one per completion, groups consecutive) and batch statistics; an MoE policy's with the
  experts each token used (`routes`, for routing replay)."""
  s = sample(lm, tok, prompts, rng, spec, mesh=mesh, rules=rules, record_routes=bool(lm.cfg.num_experts))
  total, _ = score(s, rewards, pad_id=tok.pad_id, model_reward=model_reward)
  records = [dict(prompt_index=p.index, group_id=p.index, sample=i % s.n, prompt_ids=list(map(int, p.ids)),
                  response_ids=s.tokens[i, :s.lengths[i]].astype(int).tolist(),
                  behaviour_logprobs=s.logprobs[i, :s.lengths[i]].astype(float).tolist(), reward=float(total[i]),
                  ground_truth=p.ground_truth, finish_reason=int(s.finish[i]), prompt=p.text, completion=s.texts[i],
                  policy=policy_id) for i, p in enumerate(s.owners())]
  if s.prompt_routes is not None:
    for i, (r, p) in enumerate(zip(records, s.owners())):
      whole = np.concatenate([s.prompt_routes[i, s.prompt_routes.shape[1] - len(p.ids):],
                              s.response_routes[i, :s.lengths[i]]])
      r.update(routes=whole.reshape(len(whole), -1).tolist(), route_layers=whole.shape[1])
  stats = {"rollout/reward_mean": float(np.mean(total)), "rollout/response_length_mean": float(np.mean(s.lengths)),
           "rollout/new_tokens": float(np.sum(s.lengths)), "rollout/stopped_frac": float(np.mean(s.finish))}
  return records, stats
