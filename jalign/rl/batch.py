"""The GRPO / PPO update batch: one typed pytree, from the model rows of the sampled groups to the columns the policy
and critic losses read. The step (`jalign.tasks.grpo`), the fit check (`jalign.fit`), held-out evaluation and the
tests all build it here, with keyword arguments."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jalign.data.prompts import left_pad


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RolloutBatch:
  """N rows, one per completion; a group's rows are consecutive (prompt i owns rows i*n .. i*n+n-1). P is the prompt
  bucket (prompts left-padded to it), R the response length (responses right-padded). Host (NumPy) or device arrays;
  a column the run does not use is None (an empty pytree node: it is neither sent nor compiled for).

  Model rows (every batch):
  - `tokens` [N, P+R] int32: left-padded prompt, then the response.
  - `segment_ids` [N, P+R] int32: 1 on real tokens, 0 on padding.
  - `positions` [N, P+R] int32: each token's position counting real tokens only.
  - `response` [N, R] int32: the response tokens (pad after each length).
  - `response_mask` [N, R] int32: 1 on the tokens the loss counts (multi-turn: the model's own, not observations;
    dynamic sampling: 0 on groups whose rewards are all equal).
  Float32 [N, R] columns, present as the log-prob plan (`rl.plan.LogprobPlan`) asks:
  - `advantages`: per token (`rl.stage.advantages`).
  - `old_logp`: the policy's before the update (the clipped ratio's denominator); None on-policy, where the loss
    takes its own log-probs with the gradient stopped.
  - `behaviour_logp`: the log-probs of the policy that sampled (a replay buffer's, an asynchronous rollout's) under a
    rollout correction.
  - `kept_logp`: the policy's log-probs renormalised over the tokens the sampler's filters kept.
  - `ref_logp`: the reference model's.
  - `returns`, `old_values`: the critic's targets and its values before the update (GAE).
  - `dropout_rng`: set by the train step for each micro-batch when LoRA dropout is on.
  - `routes` [N, P+R, L, k] int16 (routing replay, MoE): the experts the sampler used for each token in each layer
    (-1 = none: padding, the response's last token); the policy's forwards route by them."""
  tokens: np.ndarray | jax.Array
  segment_ids: np.ndarray | jax.Array
  positions: np.ndarray | jax.Array
  response: np.ndarray | jax.Array
  response_mask: np.ndarray | jax.Array
  advantages: np.ndarray | jax.Array | None = None
  old_logp: np.ndarray | jax.Array | None = None
  behaviour_logp: np.ndarray | jax.Array | None = None
  kept_logp: np.ndarray | jax.Array | None = None
  ref_logp: np.ndarray | jax.Array | None = None
  returns: np.ndarray | jax.Array | None = None
  old_values: np.ndarray | jax.Array | None = None
  dropout_rng: jax.Array | None = None
  routes: np.ndarray | jax.Array | None = None

  @classmethod
  def of_rows(cls, prompt_ids_NxP: np.ndarray, prompt_mask_NxP: np.ndarray, response_NxR: np.ndarray,
              lengths_N: np.ndarray) -> "RolloutBatch":
    """The model rows of left-padded prompts followed by responses of `lengths_N` tokens (host arrays)."""
    response_mask = (np.arange(response_NxR.shape[1])[None] < lengths_N[:, None]).astype(np.int32)
    segment = np.concatenate([prompt_mask_NxP, response_mask], 1)
    return cls(tokens=np.concatenate([prompt_ids_NxP, response_NxR], 1).astype(np.int32),
               segment_ids=segment.astype(np.int32),
               positions=np.maximum(np.cumsum(segment, 1) - 1, 0).astype(np.int32),
               response=response_NxR.astype(np.int32), response_mask=response_mask)

  @classmethod
  def of_groups(cls, groups, pad_id: int, *, routes: bool = False) -> "RolloutBatch":
    """The model rows of sampled `rl.groups.Groups` (each prompt repeated for its group); multi-turn, the loss mask
    keeps the observations out of the loss. `routes`: with the `routes` column (the groups' recorded experts)."""
    ids, mask = left_pad(groups.prompts, pad_id)
    n = groups.size
    batch = cls.of_rows(np.repeat(ids, n, 0), np.repeat(mask, n, 0), groups.response, groups.lengths)
    if groups.loss_mask is not None:
      batch = batch.replace(response_mask=groups.loss_mask.astype(np.int32))
    if routes:  # the prompts' routes right-aligned like the prompts, then the responses'
      prompt = pad_routes([groups.prompt_routes], left=True, width=ids.shape[1])[:, -ids.shape[1]:]
      response = pad_routes([groups.response_routes], left=False, width=groups.response.shape[1])
      batch = batch.replace(routes=np.concatenate([prompt, response[:, :groups.response.shape[1]]], 1))
    return batch

  def replace(self, **columns) -> "RolloutBatch":
    return dataclasses.replace(self, **columns)

  def columns(self) -> dict:
    """{name: array} of the columns present."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

  @property
  def rows(self) -> int:
    return int(self.response.shape[0])

  def slice(self, start: int, stop: int) -> "RolloutBatch":
    """Rows start .. stop-1 of every column."""
    return jax.tree.map(lambda v: v[start:stop], self)


def pad_routes(parts: list[np.ndarray], *, left: bool, width: int = 0) -> np.ndarray:
  """Route arrays [N_i, T_i, L, k] as one [sum N_i, max(T_i, width), L, k], padded with -1 on the left (prompts) or
  the right (responses)."""
  width = max([width] + [p.shape[1] for p in parts])
  pad = lambda p: ((0, 0), (width - p.shape[1], 0) if left else (0, width - p.shape[1]), (0, 0), (0, 0))  # noqa
  return np.concatenate([np.pad(p, pad(p), constant_values=-1) for p in parts])
