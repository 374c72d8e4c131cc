"""Multi-turn rollouts: each prompt record starts `n` episodes of an environment; turn by turn, the token ids of every
episode still running are the prompts of one batched sampling call that stops at the end-of-turn token, each
environment answers the decoded turn, and the template's observation ids are appended (`rl.episode`). An episode
ends when its environment says so, when a turn runs out of tokens before its end-of-turn token (it cannot go on
without re-tokenising), or when the next turn would pass the token budget; the last two are truncations, with no
final reward.

The result is one row per episode: the response is everything after the prompt (the model's turns and the
observations between them), the loss mask is 1 on the model's tokens only, the log-probs are the sampler's, and
each turn's reward sits on the turn's last token (the episode's return is their sum)."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import numpy as np

from jalign import sampling
from jalign.data.prompts import left_pad_ids
from jalign.models.sharding import to_host
from jalign.rl.agentic.env import Env, with_tools
from jalign.rl.agentic.episode import Episode, EpisodeError

# sample_fn(list of token-id lists) -> (tokens [B, T], log-probs [B, T], lengths [B][, routes]): one turn per row,
# stopping at (and including) the end-of-turn token; an MoE policy's sampler may add routes [B, P + T, L, k], the
# experts of each left-padded prompt column and response token (`sampling.GenerateOutput.routes`).
SampleFn = Callable[[list[list[int]]], tuple]


@dataclasses.dataclass
class Episodes:
  """`n` episodes per record, consecutive (a GRPO group)."""
  n: int
  prompt_ids: list[list[int]]          # [N] the rendered prompt of each episode
  response: np.ndarray                 # [N, R] model turns and observations after the prompt, pad after `lengths`
  lengths: np.ndarray                  # [N]
  loss_mask: np.ndarray                # [N, R] 1 on the model's own tokens
  logprobs: np.ndarray                 # [N, R] the sampler's log-probs of the model's tokens, 0 elsewhere
  rewards: np.ndarray                  # [N] the episode's return: the sum of its turns' rewards
  info: list[dict]                     # [N] turns, tool_calls, tool_errors, truncated
  episodes: list[Episode]
  token_rewards: np.ndarray            # [N, R] each turn's reward on the turn's last token (GAE's token rewards)
  # an MoE policy's (a sampler that records them): [N] arrays [len(ids), L, k], the experts of each of the episode's
  # tokens in the last sampling call that read it (-1: none, e.g. an observation after the last turn)
  routes: list[np.ndarray] | None = None

  def counts(self) -> np.ndarray:
    """[N, 4]: each episode's turns, tool calls, tool errors and whether it was truncated."""
    return np.asarray([[i[k] for k in COUNTS] for i in self.info], np.float32)

  def metrics(self) -> dict[str, float]:
    return summary(self.counts(), self.lengths)


COUNTS = ("turns", "tool_calls", "tool_errors", "truncated")


def summary(counts: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
  """The agent/* metrics of episodes' `counts` [N, 4] and token `lengths` [N]."""
  mean = counts.mean(0)
  return {"agent/turns/mean": float(mean[0]), "agent/tool_calls/mean": float(mean[1]),
          "agent/tool_errors/mean": float(mean[2]), "agent/truncated_fraction": float(mean[3]),
          "agent/episode_tokens/mean": float(np.mean(lengths))}


def sampler(lm, tok, rng, *, max_turn_tokens: int, temperature: float, pad_id: int, slots: int = 0,
            record_routes: bool = False, prefix_cache: bool = True, **kwargs) -> SampleFn:
  """A SampleFn over `sampling.generate`'s continuous batching (`slots`; 0 = one per row of the call; left-padded
  prompts; each call folds a counter into `rng`); `record_routes`: with each turn's experts (an MoE policy).
  `prefix_cache`: the slots keep each episode's conversation between calls, so a turn prefills only the model's
  last token and the new observation, and a record's episodes share their first prompt's prefill
  (`sampling.PrefixCache`, held as long as this SampleFn; with `record_routes`, the held tokens' experts too)."""
  calls = [0]
  prefix = sampling.PrefixCache() if prefix_cache else None

  def sample(rows: list[list[int]]):
    ids, mask = left_pad_ids(rows, pad_id)
    out = sampling.generate(lm, ids, mask, jax.random.fold_in(rng, calls[0]), max_new_tokens=max_turn_tokens,
                            temperature=temperature, stop_token_ids=(tok.eos_id,), pad_id=pad_id,
                            slots=slots, record_routes=record_routes, prefix_cache=prefix, **kwargs)
    calls[0] += 1
    if record_routes:
      return to_host((out.tokens, out.logprobs, out.lengths, out.routes))
    return to_host((out.tokens, out.logprobs, out.lengths))

  return sample


def rollout(make_env: Callable[[], Env], tok, records: list[dict], n: int, sample_fn: SampleFn, *,
            max_turn_tokens: int, max_tokens: int) -> Episodes:
  """`n` episodes of each record, sampled turn by turn with `sample_fn`; `max_tokens` bounds a whole episode."""
  envs = [make_env() for _ in range(len(records) * n)]
  episodes, infos, logps = [], [], []
  for i, env in enumerate(envs):
    messages, kwargs = with_tools(tok, env.reset(records[i // n]), env)
    episodes.append(Episode(tok, messages, **kwargs))
    logps.append([])
    infos.append(None)
  turn_rewards = [[] for _ in envs]  # (response position of the turn's last token, the turn's reward)
  routes = [None] * len(envs)  # per episode, when recorded: [tokens read so far, L, k]
  active = [k for k, e in enumerate(episodes) if len(e.ids) + max_turn_tokens <= max_tokens]
  for k in set(range(len(envs))) - set(active):
    infos[k] = envs[k].info(truncated=True)
  while active:
    tokens, logprobs, lengths, *recorded = sample_fn([episodes[k].ids for k in active])
    still = []
    for row, k in enumerate(active):
      ep, env, length = episodes[k], envs[k], int(lengths[row])
      if recorded:  # the conversation as this call's prefill routed it, then the new turn's tokens
        width = recorded[0].shape[1] - tokens.shape[1]  # the call's left-padded prompt width
        routes[k] = np.concatenate([recorded[0][row, width - len(ep.ids):width],
                                    recorded[0][row, width:width + length]]).astype(np.int16)
      new = [int(t) for t in tokens[row, :length]]
      ended = length > 0 and new[-1] == tok.eos_id
      content = tok.decode(new[:-1] if ended else new, skip_special_tokens=False)  # [TOOL_CALLS] etc. are content
      ep.add_model_turn(new, content)
      logps[k] += [float(x) for x in logprobs[row, :length]]
      if not ended:  # out of tokens mid-turn: the template would close a turn the model never closed
        infos[k] = env.info(truncated=True)
        continue
      step = env.step(content, new)
      infos[k] = step.info
      turn_rewards[k].append((len(ep.ids) - 1 - ep.prompt_length, step.reward))
      if step.done:
        continue
      before = len(ep.ids)
      try:
        if step.action_message is not None:
          ep.set_model_message(step.action_message)
        if step.observation and all(isinstance(t, (int, np.integer)) for t in step.observation):
          ep.add_observation_ids(step.observation)
        else:
          ep.add_observation(step.observation)
      except EpisodeError:  # the template would rewrite the model's turn: the episode cannot go on token for token
        infos[k] = {**step.info, "truncated": True, "rewritten": True}
        continue
      logps[k] += [0.0] * (len(ep.ids) - before)
      if len(ep.ids) + max_turn_tokens > max_tokens:
        infos[k] = {**step.info, "truncated": True}
        continue
      still.append(k)
    active = still
  width = max(len(e.response_ids) for e in episodes)
  response = np.zeros((len(envs), width), np.int32)
  loss_mask = np.zeros((len(envs), width), np.int32)
  logprobs = np.zeros((len(envs), width), np.float32)
  token_rewards = np.zeros((len(envs), width), np.float32)
  lengths = np.zeros(len(envs), np.int32)
  for k, e in enumerate(episodes):
    for at, reward in turn_rewards[k]:
      token_rewards[k, at] += reward
    row = e.response_ids
    response[k, :len(row)] = row
    response[k, len(row):] = tok.pad_id
    loss_mask[k, :len(row)] = e.response_mask
    logprobs[k, :len(row)] = logps[k]
    lengths[k] = len(row)
  # turns: the model turns sampled, a turn cut off by its token budget included
  infos = [{"tool_calls": 0, "tool_errors": 0, "truncated": False, "rewritten": False, **i, "turns": e.model_turns}
           for i, e in zip(infos, episodes)]
  if any(r is not None for r in routes):  # tokens no call read (observations after the last turn): -1
    shape = next(r for r in routes if r is not None).shape[1:]
    routes = [np.concatenate([np.zeros((0, *shape), np.int16) if r is None else r,
                              np.full((len(e.ids) - (0 if r is None else len(r)), *shape), -1, np.int16)])
              for r, e in zip(routes, episodes)]
  else:
    routes = None
  return Episodes(n, [e.ids[:e.prompt_length] for e in episodes], response, lengths, loss_mask, logprobs,
                  token_rewards.sum(1), infos, episodes, token_rewards, routes)
