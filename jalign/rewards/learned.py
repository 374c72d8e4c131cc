"""A reward model as an RL reward: an HF `*ForSequenceClassification` checkpoint (e.g. `configs/rm.py`'s export) or
an ensemble directory of them (`rm.members`; scores summed with the members' weights), scoring prompt + completion
token ids in-graph, on the run's mesh."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError
from jalign.rewards.ensemble import load_scorers


class ModelReward:
  def __init__(self, path: str, weight: float, mesh, rules=models.DEFAULT_RULES):
    scorers = load_scorers(path, mesh=mesh, rules=rules)
    graphdefs, self.params = [], []
    for rm, _ in scorers:
      graphdef, params = nnx.split(rm)
      params = nnx.to_pure_dict(params)
      if mesh is not None:  # the head was built off the mesh
        params = jax.device_put(params, nnx.to_pure_dict(models.state_shardings(rm, mesh, rules)))
      graphdefs.append(graphdef)
      self.params.append(params)
    self.graphdefs, self.member_weights = tuple(graphdefs), tuple(w for _, w in scorers)
    self.weight, self.path, self.mesh = weight, path, mesh
    self.max_length = min(rm.cfg.max_position_embeddings for rm, _ in scorers)

  @functools.partial(jax.jit, static_argnums=0)
  def _score(self, params, tokens, segment):
    return sum(w * nnx.merge(g, p).score(tokens, segment)
               for g, p, w in zip(self.graphdefs, params, self.member_weights))

  def __call__(self, prompt_ids: np.ndarray, prompt_mask: np.ndarray, response: np.ndarray, lengths: np.ndarray
               ) -> np.ndarray:
    """Scores [N] (unweighted) of left-padded prompts [N, P] followed by completions [N, R] of `lengths` tokens;
    rows are scored as if unpadded (positions count real tokens only)."""
    tokens = np.concatenate([prompt_ids, response], axis=1).astype(np.int32)
    segment = np.concatenate([prompt_mask, np.arange(response.shape[1])[None] < lengths[:, None]], axis=1)
    if tokens.shape[1] > self.max_length:
      raise ConfigError(f"reward model {self.path}: {tokens.shape[1]} prompt + completion positions exceed its "
                       f"max_position_embeddings={self.max_length}")
    return np.asarray(self._score(self.params, jnp.asarray(tokens), jnp.asarray(segment.astype(np.int32))))
