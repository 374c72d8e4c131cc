"""GRPO / PPO's rollout stage: a step's prompt indices -> scored groups (sampled online through `rl.rollout`, or read
from a replay buffer); then, on the devices, the update batch's advantages. Everything else here is host-side
orchestration; the model work runs in the sampler, the reward model and the jitted log-prob and critic functions it is
given."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jalign import sampling
from jalign.core.errors import ConfigError
from jalign.data.prompts import (
  Prompt,
  check_prompts,
  encode_prompt,
  ground_truth_of,
)
from jalign.data.sources import open_source
from jalign.losses import advantages as adv_lib
from jalign.losses import policy as policy_lib
from jalign.losses.advantages import AdvantageSection
from jalign.models.sharding import to_host
from jalign.parallel.distributed import say
from jalign.rewards.verifiable import NEEDS_GROUND_TRUTH, RewardSpec
from jalign.rl import rollout
from jalign.rl.agentic import agent
from jalign.rl.agentic import env as env_lib
from jalign.rl.agentic.env import EnvSection
from jalign.rl.batch import RolloutBatch, pad_routes
from jalign.rl.config import GrpoSection
from jalign.rl.groups import Groups, OfflineBuffer
from jalign.rl.partial import Partial
from jalign.rl.rollout import SamplingSection


class RolloutStage:
  """Prompts from `grpo.prompts` (online) or groups from `grpo.buffer` (offline), as `Groups`; multi-turn episodes of
  environment `env.name`; with `remax`, each prompt's greedy response scored as its baseline. `model_cfg`: the
  policy's."""

  def __init__(self, g: GrpoSection, s: SamplingSection, env: EnvSection, tok, rewards: RewardSpec, *, remax: bool,
               fields, max_prompt: int, model_cfg, mesh=None, rules=None, model_reward=None, check_records: int = 0):
    self.spec, self.tok, self.rewards, self.remax = s, tok, rewards, remax
    self.mesh, self.rules, self.model_reward = mesh, rules, model_reward
    self.encode = functools.partial(encode_prompt, tok=tok, max_length=max_prompt)
    self.offline = OfflineBuffer(g.buffer, s.num_samples, s.max_new_tokens) if g.buffer else None
    if self.offline is not None and g.routing_replay:
      self.offline.check_routes(model_cfg)
    context = model_cfg.max_position_embeddings
    self.source = open_source(g.prompts, fields) if self.offline is None else self.offline
    if self.offline is None and not env.name:  # every prompt a step may draw fits, or the run ends here
      tally = check_prompts(self.source, self.encode, limit=check_records)
      say(f"prompts {g.prompts}: {tally.summary()}")
    self.make_env = None
    if env.name:
      metric = next((name for name, _ in rewards.weights if name in NEEDS_GROUND_TRUTH), None)
      if metric is None:
        raise ConfigError(f"config.env.name={env.name!r} scores final answers with a verifiable reward; "
                          f"reward.weights has none (accepted: {', '.join(sorted(NEEDS_GROUND_TRUTH))})")
      self.make_env = functools.partial(env_lib.make, env.name, reward=metric, fmt=env.tool_format,
                                        max_turns=env.max_turns, error_reward=env.error_reward)
      self.make_answer_env = functools.partial(env_lib.make, "answer", reward=metric)
      self.max_tokens = min(env.max_tokens or context, context)

  def __len__(self) -> int:
    return len(self.source)

  def collect(self, lm, indices, key) -> Groups:
    """The groups of prompts `indices`: sampled from `lm` with `key` and scored, or read from the buffer."""
    indices = [int(i) for i in indices]
    n, pad = self.spec.num_samples, self.tok.pad_id
    if self.offline is not None:
      return self.offline.batch(indices, pad)
    if self.make_env is not None:
      return self._episodes(lm, indices, key)
    prompts = self._prompts(indices)
    # An MoE policy's experts per token: replayed by the update (grpo.routing_replay) or compared with its own
    sampled = rollout.sample(lm, self.tok, prompts, key, self.spec, mesh=self.mesh, rules=self.rules,
                             record_routes=bool(lm.cfg.num_experts))
    baselines = None
    if self.remax:  # verl: the greedy response's reward, generated for the same prompts
      greedy_spec = SamplingSection(self.spec.max_new_tokens, temperature=0.0, num_samples=1)
      greedy = rollout.sample(lm, self.tok, prompts, key, greedy_spec, mesh=self.mesh, rules=self.rules)
      baselines = np.repeat(rollout.score(greedy, self.rewards, pad_id=pad, model_reward=self.model_reward)[0], n)
    return self._scored(sampled, baselines=baselines, prompt_routes=sampled.prompt_routes,
                        response_routes=sampled.response_routes)

  def begin(self, indices) -> Partial:
    """Partial rollouts (`rl.partial`): the groups of prompts `indices`, nothing sampled yet."""
    return Partial.start(self._prompts([int(i) for i in indices]), self.spec.num_samples, self.spec.max_new_tokens,
                         self.tok.pad_id)

  def advance(self, partial: Partial, lm, key, version: int, limit: int | None) -> None:
    """One segment of `partial` sampled by `lm` (policy `version`): up to `limit` tokens more (None: to the end)."""
    partial.advance(lm, self.tok, key, self.spec, version, limit, mesh=self.mesh, rules=self.rules)

  def finish(self, partial: Partial) -> Groups:
    """A partial rollout whose responses have all ended, scored; each token with the version that sampled it."""
    return self._scored(partial.samples(self.tok), versions=partial.versions)

  def _prompts(self, indices: list[int]) -> list[Prompt]:
    return [self.encode(self.source[i], index=i, where=self.source.where(i)) for i in indices]

  def _scored(self, sampled: rollout.Samples, **extra) -> Groups:
    scores, rm_scores = rollout.score(sampled, self.rewards, pad_id=self.tok.pad_id, model_reward=self.model_reward)
    return Groups(prompts=sampled.prompts, size=sampled.n, response=sampled.tokens, lengths=sampled.lengths,
                  scores=scores, rm_scores=rm_scores, sampler_logp=sampled.logprobs, **extra)

  def _episodes(self, lm, indices: list[int], key) -> Groups:
    """Multi-turn: `n` episodes of the environment per prompt record; the response is everything after the prompt,
    its loss mask the model's own tokens."""
    s, n, tok = self.spec, self.spec.num_samples, self.tok
    records = [self.source[i] for i in indices]
    sample = agent.sampler(lm, tok, key, max_turn_tokens=s.max_new_tokens, temperature=s.temperature,
                           pad_id=tok.pad_id, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, slots=s.slots,
                           mesh=self.mesh, rules=self.rules, record_routes=bool(lm.cfg.num_experts))
    out = agent.rollout(self.make_env, tok, records, n, sample, max_turn_tokens=s.max_new_tokens,
                        max_tokens=self.max_tokens)
    prompts = [Prompt(i, out.prompt_ids[j * n], tok.decode(out.prompt_ids[j * n], skip_special_tokens=False),
                      ground_truth_of(records[j]), self.source.where(i)) for j, i in enumerate(indices)]
    width = sampling.prompt_bucket(out.response.shape[1])  # a few update shapes, not one per longest episode
    pad = lambda a, value=0: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)  # noqa: E731
    routes = {}
    if out.routes is not None:  # each episode's experts, split at its prompt like the single-turn rollouts'
      p = [len(ids) for ids in out.prompt_ids]
      routes = dict(prompt_routes=pad_routes([r[None, :n_p] for r, n_p in zip(out.routes, p)], left=True),
                    response_routes=pad_routes([r[None, n_p:] for r, n_p in zip(out.routes, p)], left=False,
                                               width=width))
    return Groups(prompts=prompts, size=n, response=pad(out.response, tok.pad_id), lengths=out.lengths,
                  scores=out.rewards, sampler_logp=pad(out.logprobs), loss_mask=pad(out.loss_mask),
                  counts=out.counts(), token_rewards=pad(out.token_rewards), **routes)

  def episode_accuracies(self, lm, records: list[dict], key, batch_size: int = 256) -> dict:
    """Greedy held-out accuracy of whole episodes (eval/accuracy) and, when the environment has tools, of one answer
    to the same records without them (eval/accuracy_no_tools): the gain the tools bring."""
    s, tok = self.spec, self.tok
    sample = agent.sampler(lm, tok, key, max_turn_tokens=s.max_new_tokens, temperature=0.0, pad_id=tok.pad_id,
                           slots=s.slots, mesh=self.mesh, rules=self.rules)
    envs = {"eval/accuracy": self.make_env}
    if env_lib.has_tools(self.make_env()):
      envs["eval/accuracy_no_tools"] = self.make_answer_env
    out = {}
    for name, make in envs.items():
      rewards = [agent.rollout(make, tok, records[i:i + batch_size], 1, sample, max_turn_tokens=s.max_new_tokens,
                               max_tokens=self.max_tokens).rewards for i in range(0, len(records), batch_size)]
      out[name] = float(np.mean(np.concatenate(rewards))) if rewards else 0.0
    return out


def advantages(a: AdvantageSection, batch: RolloutBatch, groups: Groups, *, critic, reward_kl: tuple[str, float] | None,
               dynamic_sampling: bool, sharding):
  """`batch` (on the devices) with its advantages [N, R] and, for a critic (an object with `values(batch)`), its
  `returns` and `old_values`, all computed on the devices and laid out with `sharding`; the metrics; whether every
  advantage is 0. Token rewards are the outcome on each response's last token, minus coef x KL(old || ref) per token
  when the KL goes in the reward (`reward_kl`: (estimator kind, coef); verl `apply_kl_penalty`); multi-turn, each
  turn's reward on its last token (`groups.token_rewards`, whose sums are the scores). remax subtracts
  `groups.baselines`, the greedy responses' rewards. Dynamic sampling (DAPO) masks the groups whose rewards are all
  equal out of the loss."""
  n = groups.size
  mask = batch.response_mask.astype(jnp.float32)
  token_rewards = adv_lib.outcome_to_tokens(jnp.asarray(groups.scores), mask) if groups.token_rewards is None else \
      jnp.asarray(groups.token_rewards, jnp.float32)
  metrics = {}
  if reward_kl is not None:
    kind, coef = reward_kl
    kl = policy_lib.kl_penalty(batch.old_logp, batch.ref_logp, kind) * mask
    token_rewards = token_rewards - coef * kl
    metrics["actor/reward_kl"] = float(adv_lib.masked_mean(kl, mask))
  values = critic.values(batch) if critic is not None else None
  baselines = groups.baselines
  adv, returns = adv_lib.estimate(a.estimator, token_rewards, mask, jnp.asarray(np.repeat(np.arange(len(
      groups.prompts)), n)), values_BxT=values, baselines_B=None if baselines is None else jnp.asarray(
          baselines, jnp.float32), gamma=a.gamma, lam=a.lam)
  if baselines is not None:
    metrics["critic/remax_baseline/mean"] = float(np.mean(baselines))
  columns = {"advantages": adv.astype(jnp.float32)}
  if critic is not None:
    columns.update(returns=returns.astype(jnp.float32), old_values=values.astype(jnp.float32))
    r, v, m = to_host((returns, values, mask))  # the metrics only
    real, residual = m > 0, (r - v)[m > 0]
    metrics.update({"critic/vf_explained_var": float(1.0 - residual.var() / max(r[real].var(), 1e-8)),
                    "critic/values/mean": float(v[real].mean()), "critic/returns/mean": float(r[real].mean())})
  metrics["critic/advantages/mean"] = float(adv_lib.masked_mean(adv, mask))
  if dynamic_sampling:  # DAPO: groups with identical rewards carry no signal; keep them out of the loss
    columns["response_mask"] = batch.response_mask * jnp.asarray(np.repeat(groups.informative(), n)[:, None])
  batch = batch.replace(**jax.device_put(columns, sharding))
  no_signal = not bool(jnp.any((batch.advantages != 0) & (batch.response_mask > 0)))
  return batch, metrics, no_signal


def logprob_agreement(rollout_logp: np.ndarray, trainer_logp: np.ndarray, response_mask: np.ndarray) -> dict:
  """|rollout log-prob - trainer log-prob| over the real response tokens [N, R], mean and max: how far the
  distribution the tokens were sampled from is from the one the update's ratios start from (the sampler runs the
  trainer's own model code, so online and in fp32 this is rounding; offline it is the buffer's staleness)."""
  real = np.asarray(response_mask) > 0
  diff = np.abs(np.asarray(rollout_logp, np.float64) - np.asarray(trainer_logp, np.float64))[real]
  if not diff.size:
    return {}
  return {"rollout/logprob_abs_diff_mean": float(diff.mean()), "rollout/logprob_abs_diff_max": float(diff.max())}
