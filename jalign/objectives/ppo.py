"""PPO's critic: a value model (decoder backbone + scalar head) and its clipped value loss.

The policy side of PPO is the clipped surrogate in `objectives.grpo`; what PPO adds is a learned baseline. The
critic reads the hidden state *before* each response token, the same alignment as the policy's log-probs (verl's
`dp_critic`: values at positions [-R-1, -1)), so values[:, t] estimates the return from generating token t on.
Batch keys as in `objectives.grpo` plus `returns` and `old_values` [N, R] (the rollout-time values, for clipping).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.core.sections import bounded
from jalign.losses import policy
from jalign.models import lora
from jalign.models.decoder import Decoder
from jalign.models.heads import ScalarHead
from jalign.models.reward_model import RewardModel


def make_critic(policy_lm: Decoder, *, seed: int = 0) -> RewardModel:
  """A value model initialised from the policy (its own copy of the weights) with a fresh linear value head; the
  usual choice when no reward model is given to start from (verl, OpenRLHF). A policy with LoRA adapters gives a
  critic with its own copy of the adapters on the *same* frozen base arrays (no second copy of the base)."""
  graphdef, state = nnx.split(policy_lm)
  pure = nnx.to_pure_dict(state)
  if lora.has_adapters(pure):
    adapters, base = lora.partition(pure)
    pure = lora.combine(jax.tree.map(jnp.copy, adapters), base)
  else:
    pure = jax.tree.map(jnp.copy, pure)
  nnx.replace_by_pure_dict(state, pure)
  backbone = nnx.merge(graphdef, state)
  head = ScalarHead(policy_lm.cfg.hidden_size, param_dtype=policy_lm.cfg.param_dtype, rngs=nnx.Rngs(seed))
  return RewardModel(backbone, head)


def response_values(graphdef, params, batch) -> jax.Array:
  """values [N, R]: the critic's estimate at the position before each response token (`batch`: a
  `jalign.rl.batch.RolloutBatch`)."""
  critic = nnx.merge(graphdef, params)
  hidden, _ = critic.backbone.forward(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                                      dropout_rng=batch.dropout_rng)
  r = batch.response.shape[1]
  p = batch.tokens.shape[1] - r
  return critic.head(hidden[:, p - 1:p + r - 1])


@dataclasses.dataclass(frozen=True)
class CriticSection:
  """PPO's critic (the run config's `critic` section; read with advantage.estimator='gae')."""
  lr: float = bounded(1e-5, gt=0)         # the critic's own AdamW learning rate (verl critic.optim.lr)
  value_clip: float = bounded(0.5, gt=0)  # clip of the value update around the rollout values (verl cliprange_value)
  warmup: int = bounded(0, ge=0)          # first steps update only the critic (verl trainer.critic_warmup)


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
  clip: float = 0.5                    # verl critic.cliprange_value
  agg: str = "token-mean"
  global_rows: int = 0                 # see objectives.grpo.GrpoLossConfig
  horizon: int = 0


def make_value_loss_fn(graphdef, cfg: ValueLossConfig):
  """0.5 * max((v - R)^2, (clip(v, v_old +- clip) - R)^2), aggregated over the global batch (see `losses.policy`)."""
  def loss_fn(params, batch):
    values = response_values(graphdef, params, batch)
    mask = batch.response_mask.astype(jnp.float32)
    old, returns = batch.old_values, batch.returns
    clipped = jnp.clip(values, old - cfg.clip, old + cfg.clip)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    num, den = policy.aggregate_parts(0.5 * jnp.maximum(l1, l2), mask, cfg.agg, global_rows=cfg.global_rows or None,
                                      horizon=cfg.horizon or None)
    per_token = den / jnp.maximum(jnp.sum(mask), 1.0)  # token means, summed to the step's denominator
    sums = {"critic/vf_loss": num, "critic/vf_clipfrac": jnp.sum((l2 > l1) * mask) * per_token,
            "critic/vpred_mean": jnp.sum(values * mask) * per_token}
    return num, den, sums
  return loss_fn
