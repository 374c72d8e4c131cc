"""The Bradley-Terry reward-model objective: a reward model (jalign/models/reward_model.py) scores each pair's chosen
and rejected completions.

Loss per pair (Ouyang et al. 2022, eq. 1; TRL's RewardTrainer): -log sigmoid(r_chosen - r_rejected - margin), plus
`center_rewards_coefficient * (r_chosen + r_rejected)^2` (Eisenstein et al. 2023) to keep rewards centred on zero.
An ensemble (`rm.members`) is written and read by jalign/rewards/ensemble.py.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.models.reward_model import RewardModel, last_token_index
from jalign.objectives import router


@dataclasses.dataclass(frozen=True)
class RewardLossConfig:
  center_rewards_coefficient: float = 0.0
  router: router.RouterLoss = router.RouterLoss()  # MoE backbones: the router terms (the checkpoint's, as SFT)


def pair_scores(rm: RewardModel, batch: dict) -> jax.Array:
  """[B, 2] scores (chosen, rejected) of a preference batch laid out [B, 2, L]. A batch in the split layout
  (`prompt_mask`, see `data.preference.split_pair_batch`) runs each pair's prompt once, under both completions."""
  return pair_scores_routed(rm, batch)[0]


def pair_scores_routed(rm: RewardModel, batch: dict):
  """`pair_scores`, and an MoE backbone's `Routing` over the batch (None for a dense one)."""
  b, two, length = batch["tokens"].shape
  flat = {k: batch[k].reshape(b * two, length) for k in ("tokens", "segment_ids", "positions")}
  if "prompt_mask" not in batch:
    scores, routing = rm.score_routed(flat["tokens"], flat["segment_ids"], flat["positions"],
                                      batch.get("dropout_rng"))
    return scores.reshape(b, two), routing
  p = batch["prompt_mask"].shape[1]
  # One padding column on the right, so that the states read cover the completion's last column too.
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))  # noqa: E731
  hidden, routing = rm.backbone.response_routed(pad(flat["tokens"]), segment_ids=pad(flat["segment_ids"]),
                                                positions=pad(flat["positions"]), response_len=length - p + 1,
                                                group_size=two, dropout_rng=batch.get("dropout_rng"))
  last = last_token_index(flat["segment_ids"][:, p:]) + 1  # hidden[:, j] is column p - 1 + j
  hidden_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
  return rm.head(hidden_last)[:, 0].reshape(b, two), routing


def pair_losses(chosen_B, rejected_B, margin_B, cfg: RewardLossConfig):
  """Bradley-Terry loss per pair, -log sigmoid(r_chosen - r_rejected - margin), plus TRL's reward centring
  (center_rewards_coefficient x (r_chosen + r_rejected)^2)."""
  losses = -jax.nn.log_sigmoid(chosen_B - rejected_B - margin_B)
  if cfg.center_rewards_coefficient:
    losses = losses + cfg.center_rewards_coefficient * (chosen_B + rejected_B) ** 2
  return losses


def make_loss_fn(graphdef, cfg: RewardLossConfig):
  def loss_fn(params, batch):
    rm = nnx.merge(graphdef, params)
    scores, routing = pair_scores_routed(rm, batch)
    chosen, rejected = scores[:, 0], scores[:, 1]
    diff = chosen - rejected
    losses = pair_losses(chosen, rejected, batch["margin"], cfg)
    n = jnp.asarray(losses.shape[0], jnp.float32)
    sums = {"accuracy": jnp.sum((diff > 0).astype(jnp.float32)), "margin": jnp.sum(diff),
            "rewards/chosen": jnp.sum(chosen), "rewards/rejected": jnp.sum(rejected)}
    if routing is None:
      return jnp.sum(losses), n, sums
    penalty, metrics = router.terms(routing, rm.cfg, cfg.router)  # per pair, like the loss
    return jnp.sum(losses) + penalty * n, n, {**sums, **{k: v * n for k, v in metrics.items()}}
  return loss_fn


@dataclasses.dataclass(frozen=True)
class RewardMember:
  """A further reward model of an ensemble: trained like the run's own model (same backbone, head and optimizer) on
  its own pairs, for its own steps; the ensemble's score adds `weight` x its score to the run's model's."""
  train: str = ""  # its training pairs (the forms of data.train)
  steps: int = 0
  weight: float = bounded(1.0, gt=0)


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
  head: Literal["linear", "mlp"] = "linear"  # scalar head on the last real token's hidden state
  head_bias: bool = False                 # HF *ForSequenceClassification has none; export needs linear, no bias
  mlp_size: int = bounded(0, ge=0)        # mlp head width; 0 = hidden size
  center_rewards_coefficient: float = bounded(0.0, ge=0)  # TRL: + coef * (r_c + r_r)^2 (Eisenstein et al. 2023); 0 =
                                          # off
  share_prompt: bool = True               # each pair's prompt runs once, under both completions (prefix sharing)
  members: tuple[RewardMember, ...] = ()  # () = one reward model; else an ensemble: the run's model + these, scores
                                          # summed (jalign/tasks/rm.py)

  def check(self, *, export_hf: bool) -> None:
    if export_hf and (self.head != "linear" or self.head_bias):
      raise ConfigError(f"config.rm.head={self.head!r}, head_bias={self.head_bias}: an HF sequence-classification "
                        "checkpoint holds one linear score without bias; use rm.head='linear', rm.head_bias=False or "
                        "set checkpoint.export_hf=False")
    for i, m in enumerate(self.members):
      key = f"config.rm.members[{i}]"
      if not m.train:
        raise ConfigError(f"{key}.train is empty: each member needs its training pairs (a file, glob or tfds spec)")
      if m.steps <= 0:
        raise ConfigError(f"{key}.steps={m.steps}: must be positive")
    if self.members and not export_hf:
      raise ConfigError("config.rm.members: the ensemble is assembled from each member's exported checkpoint; set "
                        "checkpoint.export_hf=True")
