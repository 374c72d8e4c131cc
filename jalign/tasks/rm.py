"""The reward-model task: Bradley-Terry training of a backbone + scalar head on preference pairs.

The backbone comes from `model.path` (a causal LM such as the shipped tiny policy, whose LM head is dropped, or a
`*ForSequenceClassification` reward model, whose score head is kept) or from `model.arch`. Held-out evaluation:
pairwise accuracy, mean margin, and Spearman / Kendall correlation of the scores with the data's gold scores
(`chosen_score` / `rejected_score`) when every pair has them. Exported as an HF sequence-classification checkpoint.

With `rm.members`, the run then trains each member the same way on its own pairs (in run_dir/members/<i>, each
resuming there like any run) and assembles run_dir/ensemble: the run's model and the members, scores summed with
their weights, evaluated on the same held-out pairs. Use it where one set of weights does not hold every check the
preferences need (the built-in task: the ones-digit check and the size of the error, see benchmarks/README.md).
"""
from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from jalign import models
from jalign.config import RunConfig
from jalign.core.errors import ConfigError
from jalign.data import preference
from jalign.eval import policy as policy_eval
from jalign.eval import ranking
from jalign.models.reward_model import RewardModel
from jalign.objectives import reward as objective
from jalign.parallel.distributed import is_main, say
from jalign.rewards.ensemble import write_ensemble
from jalign.tasks.preference import PreferenceTask
from jalign.tokenizers import tokenizer as tokenizer_lib
from jalign.train import loop
from jalign.train.task import Setup


def load_reward_model(cfg: RunConfig, mesh) -> RewardModel:
  m, r = cfg.model, cfg.rm
  knobs = m.knobs()
  if m.path and models.is_sequence_classifier(m.path):
    if r.head != "linear":
      raise ConfigError(f"{m.path} is a sequence classifier with a linear score head; config.rm.head={r.head!r}")
    backbone, score = models.load_sequence_classifier(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                                      compute_dtype=m.compute_dtype or m.dtype, **knobs)
    return RewardModel.from_classifier(backbone, score)
  if m.path:  # a causal LM: the backbone without its LM head (tied: nothing to drop)
    backbone = models.from_pretrained(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                      compute_dtype=m.compute_dtype or m.dtype, tie_embeddings=True, **knobs)
  else:
    arch = m.arch.replace(param_dtype=m.dtype, dtype=m.compute_dtype or m.dtype, tie_embeddings=True, **knobs)
    backbone = models.create(arch, seed=cfg.seed, mesh=mesh, rules=cfg.mesh.rules)
  return RewardModel(backbone, score_head(cfg, backbone.cfg.hidden_size))


def score_head(cfg: RunConfig, hidden_size: int) -> models.ScalarHead:
  """A new reward head as `rm.head`, `rm.mlp_size` and `rm.head_bias` say (fp32)."""
  r = cfg.rm
  return models.ScalarHead(hidden_size, kind=r.head, mlp_size=r.mlp_size or None, bias=r.head_bias,
                           param_dtype="float32", rngs=nnx.Rngs(cfg.seed))


class RewardTask(PreferenceTask):
  def __init__(self, cfg: RunConfig):
    super().__init__(cfg)
    if cfg.rm.share_prompt:  # prefix sharing: the prompt's forward and backward once per pair
      self.batch_fn = preference.split_pair_batch

  def load_model(self, cfg, mesh):
    return load_reward_model(cfg, mesh)

  def make_loss_fn(self, graphdef):
    return objective.make_loss_fn(graphdef, objective.RewardLossConfig(self.cfg.rm.center_rewards_coefficient,
                                                                       self.router_loss()))

  def start(self, setup: Setup) -> None:
    super().start(setup)
    self._scores = jax.jit(lambda params, batch: objective.pair_scores(nnx.merge(setup.graphdef, params), batch))

  def build(self, setup, optimizer, schedule):
    iterator = super().build(setup, optimizer, schedule)
    self.eval_loss = None  # the held-out loss comes from `evaluate`'s one pass over the held-out pairs
    return iterator

  def evaluate(self, setup, params) -> dict:
    """One pass over the held-out pairs (`eval_pairs`): the loss, the mean rewards, pairwise accuracy, mean margin
    and the rank correlations, each under one name."""
    spec = self.cfg.data.eval
    if not spec:
      return {}
    examples = self.examples(spec, eval_pairs(self.cfg))
    scores = np.concatenate(self.map_batches(examples, lambda b: self._scores(params, b),
                                             what=f"held-out pairs of {spec}"))  # [N, 2]
    margin = np.asarray([e.get("margin", 0.0) for e in examples], np.float32)
    loss_cfg = objective.RewardLossConfig(self.cfg.rm.center_rewards_coefficient)
    losses = np.asarray(objective.pair_losses(scores[:, 0], scores[:, 1], margin, loss_cfg))
    return {"eval/loss": float(losses.mean()), "eval/rewards/chosen": float(scores[:, 0].mean()),
            "eval/rewards/rejected": float(scores[:, 1].mean()), **pair_metrics(scores, examples)}

  def export(self, module, out_dir, tok) -> None:
    models.save_pretrained(module.backbone, out_dir, tokenizer=tok, score=module.head.w_out[...][:, 0])


def eval_pairs(cfg: RunConfig) -> int:
  """How many held-out pairs a reward model is evaluated on: train.eval_examples, else train.eval_batches batches of
  train.batch_size pairs; 0 = all."""
  t = cfg.train
  return t.eval_examples or t.eval_batches * t.batch_size


def pair_metrics(scores: np.ndarray, examples: list[dict]) -> dict:
  """Held-out pairwise accuracy and mean margin; rank correlations with gold scores when every pair has them."""
  return {"eval/" + k: v for k, v in ranking.pair_metrics(scores, examples).items()}


def member_config(cfg: RunConfig, index: int) -> RunConfig:
  """The run of ensemble member `index` (1-based): the run's own settings with the member's pairs, steps and seed
  (the run's + index), in run_dir/members/<index>."""
  m = cfg.rm.members[index - 1]
  return dataclasses.replace(cfg, run_dir=os.path.join(cfg.run_dir, "members", str(index)), seed=cfg.seed + index,
                             data=dataclasses.replace(cfg.data, train=m.train),
                             train=dataclasses.replace(cfg.train, steps=m.steps),
                             rm=dataclasses.replace(cfg.rm, members=()))


def reward_model_dir(cfg: RunConfig) -> str:
  """Where the run's reward model ends up: run_dir/hf, or run_dir/ensemble with `rm.members`."""
  return os.path.join(cfg.run_dir, "ensemble" if cfg.rm.members else "hf")


def task(cfg: RunConfig) -> RewardTask:
  return RewardTask(cfg)


def run(cfg: RunConfig) -> dict:
  final = loop.run(cfg, task(cfg))
  if not cfg.rm.members:
    return final
  members = [(os.path.join(cfg.run_dir, "hf"), 1.0)]
  for i, m in enumerate(cfg.rm.members, 1):
    member = member_config(cfg, i)
    say(f"reward-model ensemble, member {i} of {len(cfg.rm.members)}: {m.steps} steps on {m.train} -> "
        f"{member.run_dir}")
    out = loop.run(member, RewardTask(member))
    final.update({f"member{i}/{k}": v for k, v in out.items() if k.startswith("eval/")})
    members.append((os.path.join(member.run_dir, "hf"), m.weight))
  path = reward_model_dir(cfg)
  if is_main():
    write_ensemble(path, members)
  if jax.process_count() > 1:  # the other processes read what process 0 wrote
    multihost_utils.sync_global_devices("reward-model ensemble written")
  if cfg.data.eval:
    tok = tokenizer_lib.load(os.path.join(path, "0"))
    scores = policy_eval.pair_metrics(path, tok, cfg.data.eval, max_length=cfg.data.max_length,
                                      batch_size=cfg.train.batch_size, limit=eval_pairs(cfg))
    final.update({"ensemble/" + k.removeprefix("rm/"): v for k, v in scores.items()})
    say("reward-model ensemble: " + "  ".join(f"{k}={v:.4f}" for k, v in final.items() if k.startswith("ensemble/"))
        + f"  ({path})")
  return final
