"""The reward-model task: Bradley-Terry training of a backbone + scalar head on preference pairs.

The backbone comes from `model.path` (a causal LM such as the shipped tiny policy, whose LM head is dropped, or a
`*ForSequenceClassification` reward model, whose score head is kept) or from `model.arch`. Held-out evaluation:
pairwise accuracy, mean margin, and Spearman / Kendall correlation of the scores with the data's gold scores
(`chosen_score` / `rejected_score`) when every pair has them. Exported as an HF sequence-classification checkpoint.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jalign import models
from jalign.config import RunConfig
from jalign.data import preference
from jalign.eval import ranking
from jalign.objectives import reward as objective
from jalign.train import loop
from jalign.train.preference import PreferenceTask


def load_reward_model(cfg: RunConfig, mesh) -> objective.RewardModel:
  m, r = cfg.model, cfg.rm
  knobs = dict(scan_layers=m.scan_layers, remat=m.remat)
  if m.path and models.is_sequence_classifier(m.path):
    if r.head != "linear":
      raise ValueError(f"{m.path} is a sequence classifier with a linear score head; config.rm.head={r.head!r}")
    backbone, score = models.load_sequence_classifier(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                                      compute_dtype=m.compute_dtype or m.dtype, **knobs)
    return objective.RewardModel.from_classifier(backbone, score)
  if m.path:  # a causal LM: the backbone without its LM head (tied: nothing to drop)
    backbone = models.from_pretrained(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                      compute_dtype=m.compute_dtype or m.dtype, tie_embeddings=True, **knobs)
  else:
    arch = m.arch.replace(param_dtype=m.dtype, dtype=m.compute_dtype or m.dtype, tie_embeddings=True, **knobs)
    backbone = models.create(arch, seed=cfg.seed, mesh=mesh, rules=cfg.mesh.rules)
  head = models.ScalarHead(backbone.cfg.hidden_size, kind=r.head, mlp_size=r.mlp_size or None, bias=r.head_bias,
                           param_dtype="float32", rngs=nnx.Rngs(cfg.seed))
  return objective.RewardModel(backbone, head)


class RewardTask(PreferenceTask):
  def __init__(self, cfg: RunConfig):
    super().__init__(cfg)
    if cfg.rm.share_prompt:  # prefix sharing: the prompt's forward and backward once per pair
      self.batch_fn = preference.split_pair_batch

  def load_model(self, cfg, mesh):
    return load_reward_model(cfg, mesh)

  def make_loss_fn(self, graphdef):
    return objective.make_loss_fn(graphdef, objective.RewardLossConfig(self.cfg.rm.center_rewards_coefficient))

  def start(self, setup: loop.Setup) -> None:
    super().start(setup)
    self._scores = jax.jit(lambda params, batch: objective.pair_scores(nnx.merge(setup.graphdef, params), batch))

  def evaluate(self, setup, params) -> dict:
    spec = self.cfg.data.eval
    if not spec:
      return {}
    examples = self.examples(spec, self.cfg.train.eval_examples)
    scores = np.concatenate(self.map_batches(examples, lambda b: self._scores(params, b)))  # [N, 2]
    return pair_metrics(scores, examples)

  def export(self, module, out_dir, tok) -> None:
    models.save_pretrained(module.backbone, out_dir, tokenizer=tok, score=module.head.w_out[...][:, 0])


def pair_metrics(scores: np.ndarray, examples: list[dict]) -> dict:
  """Held-out pairwise accuracy and mean margin; rank correlations with gold scores when every pair has them."""
  return {"eval/" + k: v for k, v in ranking.pair_metrics(scores, examples).items()}


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, RewardTask(cfg))
