"""Advantage estimators, with the semantics and defaults of verl's `trainer/ppo/core_algos.py`.

Shapes: token-level arrays are [B, T] with a response mask (1 on response tokens); outcome scores are [B];
`group_ids` [B] are dense ints in [0, B) (rows of one prompt share an id).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jalign.core.sections import bounded

# Estimators whose values for one group depend on that group's samples alone (no batch whitening, no critic): leaving
# other groups out of the batch does not change them.
GROUP_LOCAL_ESTIMATORS = ("grpo", "drgrpo", "rloo", "remax")


@dataclasses.dataclass(frozen=True)
class AdvantageSection:
  """How rewards become advantages (the run config's `advantage` section, read by GRPO and PPO)."""
  # grpo / drgrpo / rloo: group baselines; gae: PPO with a learned critic; reinforce_pp(_baseline): REINFORCE++;
  # remax: each prompt's greedy response, sampled and scored alongside, is the baseline (Li et al. 2023).
  estimator: Literal["grpo", "drgrpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline", "remax"] = "grpo"
  gamma: float = bounded(1.0, ge=0, le=1)  # discount (verl algorithm.gamma)
  lam: float = bounded(1.0, ge=0, le=1)   # GAE lambda (verl algorithm.lam)


def masked_mean(x, mask, axis=None):
  return jnp.sum(x * mask, axis=axis) / jnp.maximum(jnp.sum(mask, axis=axis), 1e-8)


def masked_whiten(x, mask, shift_mean: bool = True):
  """verl `masked_whiten`: (x - mean) / sqrt(unbiased var + 1e-8) over masked entries, mean added back unless
  shift_mean."""
  mean = masked_mean(x, mask)
  n = jnp.sum(mask)
  var = masked_mean((x - mean) ** 2, mask) * n / jnp.maximum(n - 1, 1)
  out = (x - mean) * jax.lax.rsqrt(var + 1e-8)
  return out if shift_mean else out + mean


def gae(token_rewards_BxT, values_BxT, mask_BxT, *, gamma: float, lam: float):
  """Generalised advantage estimation (Schulman et al. 2016). Masked-out positions (e.g. tool/observation tokens in
  multi-turn rollouts) neither bootstrap nor accumulate; returns are taken before whitening, then advantages are
  whitened over the mask (verl `compute_gae_advantage_return`)."""
  mask = mask_BxT.astype(jnp.float32)

  def step(carry, xs):
    next_value, last_gae = carry
    r, v, m = xs
    delta = r + gamma * next_value - v
    gae_t = delta + gamma * lam * last_gae
    next_value = v * m + (1 - m) * next_value
    last_gae = gae_t * m + (1 - m) * last_gae
    return (next_value, last_gae), last_gae

  zeros = jnp.zeros(token_rewards_BxT.shape[0], jnp.float32)
  xs = (token_rewards_BxT.T.astype(jnp.float32), values_BxT.T.astype(jnp.float32), mask.T)
  _, adv_TxB = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
  advantages = adv_TxB.T
  returns = advantages + values_BxT
  return masked_whiten(advantages, mask), returns


def _group_stats(scores_B, group_ids_B):
  n = scores_B.shape[0]
  count = jax.ops.segment_sum(jnp.ones_like(scores_B), group_ids_B, n)
  total = jax.ops.segment_sum(scores_B, group_ids_B, n)
  mean = total / jnp.maximum(count, 1)
  sq = jax.ops.segment_sum((scores_B - mean[group_ids_B]) ** 2, group_ids_B, n)
  std = jnp.sqrt(sq / jnp.maximum(count - 1, 1))  # unbiased, as torch.std
  return count[group_ids_B], mean[group_ids_B], std[group_ids_B]


def grpo(scores_B, group_ids_B, *, norm_by_std: bool = True, eps: float = 1e-6):
  """GRPO group normalisation: (r - mean_group) / (std_group + eps), unbiased std; a group of one gets mean 0 and
  std 1. norm_by_std=False is Dr. GRPO (Liu et al. 2025): no division by the std."""
  scores = scores_B.astype(jnp.float32)
  count, mean, std = _group_stats(scores, group_ids_B)
  mean = jnp.where(count > 1, mean, 0.0)
  std = jnp.where(count > 1, std, 1.0)
  return (scores - mean) / (std + eps) if norm_by_std else scores - mean


def rloo(scores_B, group_ids_B):
  """REINFORCE leave-one-out (Ahmadian et al. 2024): r_i - mean of the other samples of the group."""
  scores = scores_B.astype(jnp.float32)
  count, mean, _ = _group_stats(scores, group_ids_B)
  return jnp.where(count > 1, (scores - mean) * count / jnp.maximum(count - 1, 1), scores)


def reinforce_pp(token_rewards_BxT, mask_BxT, *, gamma: float = 1.0):
  """REINFORCE++ (Hu 2025): discounted returns reset after each response's end, whitened over the batch."""
  mask = mask_BxT.astype(jnp.float32)

  def step(running, xs):
    r, m = xs
    running = r + gamma * running
    return running * m, running

  _, returns_TxB = jax.lax.scan(step, jnp.zeros(token_rewards_BxT.shape[0], jnp.float32),
                                (token_rewards_BxT.T.astype(jnp.float32), mask.T), reverse=True)
  returns = returns_TxB.T
  return masked_whiten(returns, mask) * mask, returns


def reinforce_pp_baseline(scores_B, group_ids_B, mask_BxT):
  """REINFORCE++-baseline: subtract the group mean, broadcast over the response, whiten over the batch."""
  scores = scores_B.astype(jnp.float32)
  count, mean, _ = _group_stats(scores, group_ids_B)
  centred = scores - jnp.where(count > 1, mean, 0.0)
  mask = mask_BxT.astype(jnp.float32)
  return masked_whiten(centred[:, None] * mask, mask) * mask


def remax(token_rewards_BxT, baselines_B, mask_BxT):
  """ReMax (Li et al. 2023): reward-to-go minus the greedy response's reward as baseline."""
  mask = mask_BxT.astype(jnp.float32)
  returns = jnp.flip(jnp.cumsum(jnp.flip(token_rewards_BxT * mask, -1), -1), -1)
  return returns - baselines_B[:, None] * mask, returns


def outcome_to_tokens(scores_B, mask_BxT):
  """Place each sequence's outcome score on its last response token (verl's token_level_rewards layout)."""
  mask = mask_BxT.astype(jnp.float32)
  last = jnp.max(jnp.where(mask > 0, jnp.arange(mask.shape[1]), -1), axis=1)
  return jax.nn.one_hot(last, mask.shape[1]) * scores_B[:, None]


ESTIMATORS = ("grpo", "drgrpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline", "remax")


def estimate(estimator: str, token_rewards_BxT, mask_BxT, group_ids_B, *, values_BxT=None, baselines_B=None,
             gamma: float = 1.0, lam: float = 1.0):
  """(advantages [B, T], returns [B, T] or None) by name, from token-level rewards (the outcome on the last token,
  minus any in-reward KL). Outcome-based estimators score a sequence by its summed token rewards, as verl does.
  `values_BxT`: the critic's (gae); `baselines_B`: the reward of each row's prompt's greedy response (remax)."""
  mask = mask_BxT.astype(jnp.float32)
  if estimator == "gae":
    return gae(token_rewards_BxT, values_BxT, mask, gamma=gamma, lam=lam)
  if estimator == "remax":
    if baselines_B is None:
      raise ValueError("remax needs baselines_B: the reward of each prompt's greedy response")
    return remax(token_rewards_BxT, baselines_B, mask)
  if estimator == "reinforce_pp":
    return reinforce_pp(token_rewards_BxT, mask, gamma=gamma)
  scores = jnp.sum(token_rewards_BxT * mask, axis=-1)
  if estimator == "reinforce_pp_baseline":
    return reinforce_pp_baseline(scores, group_ids_B, mask), None
  if estimator == "rloo":
    return rloo(scores, group_ids_B)[:, None] * mask, None
  if estimator in ("grpo", "drgrpo"):
    return grpo(scores, group_ids_B, norm_by_std=estimator == "grpo")[:, None] * mask, None
  raise ValueError(f"advantage estimator {estimator!r}; accepted: {', '.join(ESTIMATORS)}")
