"""A reward model as an RL reward: an HF `*ForSequenceClassification` checkpoint (e.g. `configs/rm.py`'s export)
scoring prompt + completion token ids in-graph, on the run's mesh."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models
from jalign.objectives.reward import RewardModel


class ModelReward:
  def __init__(self, path: str, weight: float, mesh, rules=models.DEFAULT_RULES):
    backbone, score = models.load_sequence_classifier(path, mesh=mesh, rules=rules)
    rm = RewardModel.from_classifier(backbone, score)
    self.graphdef, params = nnx.split(rm)
    self.params = nnx.to_pure_dict(params)
    if mesh is not None:  # the head was built off the mesh
      self.params = jax.device_put(self.params, nnx.to_pure_dict(models.state_shardings(rm, mesh, rules)))
    self.weight, self.path, self.mesh = weight, path, mesh
    self.max_length = backbone.cfg.max_position_embeddings

  @functools.partial(jax.jit, static_argnums=0)
  def _score(self, params, tokens, segment):
    return nnx.merge(self.graphdef, params).score(tokens, segment)

  def __call__(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, response: np.ndarray, lengths: np.ndarray
               ) -> np.ndarray:
    """Scores [N] (unweighted) of left-padded prompts [N, P] followed by completions [N, R] of `lengths` tokens;
    rows are scored as if unpadded (positions count real tokens only)."""
    tokens = np.concatenate([prompt_ids, response], axis=1).astype(np.int32)
    segment = np.concatenate([prompt_mask, np.arange(response.shape[1])[None] < lengths[:, None]], axis=1)
    if tokens.shape[1] > self.max_length:
      raise ValueError(f"reward model {self.path}: {tokens.shape[1]} prompt + completion positions exceed its "
                       f"max_position_embeddings={self.max_length}")
    return np.asarray(self._score(self.params, jnp.asarray(tokens), jnp.asarray(segment.astype(np.int32))))
