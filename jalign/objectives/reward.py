"""Bradley-Terry reward models: a decoder backbone plus a scalar head read at each sequence's last real token.

Loss per pair (Ouyang et al. 2022, eq. 1; TRL's RewardTrainer): -log sigmoid(r_chosen - r_rejected - margin), plus
`center_rewards_coefficient * (r_chosen + r_rejected)^2` (Eisenstein et al. 2023) to keep rewards centred on zero.

An ensemble (`rm.members`) is a directory holding one HF sequence-classification checkpoint per member (`0/`,
`1/`, ...) and `reward_ensemble.json` with each member's weight; its score is the weighted sum of theirs (several
reward models combined into one reward, as Llama 2's separate helpfulness and safety models, Touvron et al. 2023,
sec. 3.2.2). `load_scorers` reads either kind.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.errors import CheckpointError, ConfigError
from jalign.models.decoder import Decoder
from jalign.models.heads import ScalarHead
from jalign.models.hf import load_sequence_classifier
from jalign.sections import bounded


def last_token_index(mask_BxT: jax.Array) -> jax.Array:
  """Index of each row's last real token (right or left padding)."""
  positions = jnp.arange(mask_BxT.shape[1])
  return jnp.max(jnp.where(mask_BxT > 0, positions, -1), axis=1)


class RewardModel(nnx.Module):
  def __init__(self, backbone: Decoder, head: ScalarHead):
    self.backbone = backbone
    self.head = head

  @classmethod
  def from_classifier(cls, backbone: Decoder, score_D) -> "RewardModel":
    """The model of an HF one-label classifier: its backbone and its linear `score` weight [D] (no bias)."""
    head = ScalarHead(backbone.cfg.hidden_size, bias=False, rngs=nnx.Rngs(0))
    head.w_out[...] = jnp.asarray(score_D, jnp.float32)[:, None]
    return cls(backbone, head)

  @property
  def cfg(self):
    return self.backbone.cfg

  def score(self, tokens_BxT: jax.Array, segment_ids_BxT: jax.Array, positions_BxT: jax.Array | None = None,
            dropout_rng: jax.Array | None = None) -> jax.Array:
    """Scores [B] of (right- or left-) padded sequences; `segment_ids` is 1 on real tokens, 0 on padding. Pure and
    jittable: RL loops call it inside their own jitted scoring step."""
    if positions_BxT is None:
      positions_BxT = jnp.maximum(jnp.cumsum(segment_ids_BxT, axis=1) - 1, 0)
    hidden, _ = self.backbone.forward(tokens_BxT, segment_ids=segment_ids_BxT, positions=positions_BxT,
                                      dropout_rng=dropout_rng)
    last = last_token_index(segment_ids_BxT)
    hidden_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # the head on one token per row
    return self.head(hidden_last)[:, 0]


ENSEMBLE_FILE = "reward_ensemble.json"


def is_ensemble(path: str) -> bool:
  return os.path.isfile(os.path.join(path, ENSEMBLE_FILE))


def ensemble_members(path: str) -> list[tuple[str, float]]:
  """[(member checkpoint directory, weight)] of the ensemble at `path`; malformed files get an error naming them."""
  file = os.path.join(path, ENSEMBLE_FILE)
  try:
    members = json.load(open(file, encoding="utf-8"))["members"]
    out = [(os.path.join(path, str(m["path"])), float(m["weight"])) for m in members]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f'{file}: expected {{"members": [{{"path": DIR, "weight": NUMBER}}, ...]}} ({e!r})') from None
  if not out or not all(math.isfinite(w) for _, w in out):
    raise CheckpointError(f"{file}: needs at least one member, each with a finite weight")
  for d, _ in out:
    if not os.path.isfile(os.path.join(d, "config.json")):
      raise CheckpointError(f"{file}: member {d!r} is not an HF checkpoint directory (no config.json)")
  return out


def write_ensemble(out_dir: str, members: list[tuple[str, float]]) -> None:
  """Copies each member's exported checkpoint into `out_dir`/<i> beside `reward_ensemble.json`. Built under a
  temporary name and renamed, so an interrupted write leaves the previous ensemble (or none), never half of one."""
  tmp = out_dir.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for i, (src, _) in enumerate(members):
    shutil.copytree(src, os.path.join(tmp, str(i)))
  with open(os.path.join(tmp, ENSEMBLE_FILE), "w", encoding="utf-8") as f:
    json.dump({"members": [{"path": str(i), "weight": w} for i, (_, w) in enumerate(members)]}, f, indent=1)
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.replace(tmp, out_dir)


def load_scorers(path: str, **kwargs) -> list[tuple[RewardModel, float]]:
  """[(reward model, weight)]: the members of an ensemble directory, or one HF `*ForSequenceClassification`
  checkpoint with weight 1. `kwargs` go to `models.load_sequence_classifier`."""
  paths = ensemble_members(path) if is_ensemble(path) else [(path, 1.0)]
  out = []
  for p, w in paths:
    backbone, score = load_sequence_classifier(p, **kwargs)
    out.append((RewardModel.from_classifier(backbone, score), w))
  return out


@dataclasses.dataclass(frozen=True)
class RewardLossConfig:
  center_rewards_coefficient: float = 0.0


def pair_scores(rm: RewardModel, batch: dict) -> jax.Array:
  """[B, 2] scores (chosen, rejected) of a preference batch laid out [B, 2, L]. A batch in the split layout
  (`prompt_mask`, see `data.preference.split_pair_batch`) runs each pair's prompt once, under both completions."""
  b, two, length = batch["tokens"].shape
  flat = {k: batch[k].reshape(b * two, length) for k in ("tokens", "segment_ids", "positions")}
  if "prompt_mask" not in batch:
    return rm.score(flat["tokens"], flat["segment_ids"], flat["positions"], batch.get("dropout_rng")).reshape(b, two)
  p = batch["prompt_mask"].shape[1]
  # One padding column on the right, so that the states read cover the completion's last column too.
  pad = lambda x: jnp.pad(x, ((0, 0), (0, 1)))  # noqa: E731
  hidden = rm.backbone.response_hidden(pad(flat["tokens"]), segment_ids=pad(flat["segment_ids"]),
                                       positions=pad(flat["positions"]), response_len=length - p + 1,
                                       group_size=two, dropout_rng=batch.get("dropout_rng"))
  last = last_token_index(flat["segment_ids"][:, p:]) + 1  # hidden[:, j] is column p - 1 + j
  hidden_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)
  return rm.head(hidden_last)[:, 0].reshape(b, two)


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
    scores = pair_scores(rm, batch)
    chosen, rejected = scores[:, 0], scores[:, 1]
    diff = chosen - rejected
    losses = pair_losses(chosen, rejected, batch["margin"], cfg)
    n = jnp.asarray(losses.shape[0], jnp.float32)
    sums = {"accuracy": jnp.sum((diff > 0).astype(jnp.float32)), "margin": jnp.sum(diff),
            "rewards/chosen": jnp.sum(chosen), "rewards/rejected": jnp.sum(rejected)}
    return jnp.sum(losses), n, sums
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
