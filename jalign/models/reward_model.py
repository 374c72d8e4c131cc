"""A reward model: a decoder backbone plus a scalar head read at each sequence's last real token (the Bradley-Terry
reward models of jalign/objectives/reward.py, PPO's critic, and HF `*ForSequenceClassification` checkpoints)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.models.decoder import Decoder
from jalign.models.heads import ScalarHead


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
    return self.score_routed(tokens_BxT, segment_ids_BxT, positions_BxT, dropout_rng)[0]

  def score_routed(self, tokens_BxT, segment_ids_BxT, positions_BxT=None, dropout_rng=None):
    """`score`, and an MoE backbone's `Routing` (None for a dense one)."""
    if positions_BxT is None:
      positions_BxT = jnp.maximum(jnp.cumsum(segment_ids_BxT, axis=1) - 1, 0)
    hidden, _, routing = self.backbone.forward_routed(tokens_BxT, segment_ids=segment_ids_BxT,
                                                      positions=positions_BxT, dropout_rng=dropout_rng)
    last = last_token_index(segment_ids_BxT)
    hidden_last = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # the head on one token per row
    return self.head(hidden_last)[:, 0], routing
