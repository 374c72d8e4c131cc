"""Which log-prob columns a GRPO / PPO update batch carries, decided once from the config: the step
(`jalign.tasks.grpo`) computes exactly these, and the fit check compiles the update on a batch with exactly these."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jalign.data.prompts import Prompt
from jalign.rl.batch import RolloutBatch
from jalign.rl.groups import Groups


@dataclasses.dataclass(frozen=True)
class LogprobPlan:
  """- `stored`: the rollout's own log-probs (offline: the buffer's; asynchronous: the sampler's) enter the batch as
    `old_logp` (the clipped ratio's denominator) or, under a rollout correction, as `behaviour_logp`; '' = none.
  - `current_old`: `old_logp` is the policy's before this step's update (one forward pass); else, on-policy, the
    update takes it from its own forward with the gradient stopped (`objectives.grpo`).
  - `kept`: `kept_logp`, the policy's log-probs renormalised over the set sampling kept (a rollout correction after
    top-k / top-p / min-p filtering).
  - `reference`: `ref_logp` every step (a KL term in the loss or in the reward, the adaptive KL, or kl.max);
    else the reference runs only on the steps that report the KL to it.
  - `critic`: `returns` and `old_values` for the critic (GAE)."""
  stored: str = ""
  current_old: bool = False
  kept: bool = False
  reference: bool = False
  critic: bool = False

  @staticmethod
  def of(cfg) -> "LogprobPlan":
    """The plan of a run config's (`jalign.config.RunConfig`) grpo, sampling, kl, policy_loss and advantage
    sections."""
    g, s, corrects = cfg.grpo, cfg.sampling, cfg.policy_loss.corrects
    behaviour = bool(g.buffer) or bool(g.async_staleness)  # sampled by another policy than the current one
    old_is_current = not behaviour or corrects
    filtered = bool(s.top_k or s.top_p < 1 or s.min_p > 0)
    return LogprobPlan(
        stored="" if not behaviour else "behaviour_logp" if corrects else "old_logp",
        current_old=old_is_current and (g.ppo_epochs > 1 or g.mini_batches > 1 or cfg.kl.in_reward),
        kept=filtered and corrects,
        reference=cfg.kl.needs_reference,
        critic=cfg.advantage.estimator == "gae")

  def columns(self) -> tuple[str, ...]:
    """The float32 [N, R] columns of the update batch beside the model rows (`rl.batch.RolloutBatch`)."""
    names = [self.stored, "old_logp" if self.current_old else "", "kept_logp" if self.kept else "",
             "ref_logp" if self.reference else "", "advantages"]
    return tuple(dict.fromkeys(n for n in names if n)) + (("returns", "old_values") if self.critic else ())

  def abstract_batch(self, rows: int, group_size: int, prompt_length: int, response_length: int,
                     route_shape: tuple[int, int] | None = None) -> RolloutBatch:
    """Shapes and dtypes of an update batch of `rows` rows: prompts of `prompt_length` tokens (left-padded to the
    sampler's bucket, as `RolloutBatch.of_groups` lays them out) and responses of `response_length`, with
    `columns`; with `route_shape` (layers, experts per token), the routes routing replay reads."""
    prompts = [Prompt(i, [0] * prompt_length, "", None, "") for i in range(rows // group_size)]
    routes = lambda width: None if route_shape is None else np.zeros((rows, width, *route_shape), np.int16)  # noqa
    groups = Groups(prompts=prompts, size=group_size, response=np.zeros((rows, response_length), np.int32),
                    lengths=np.full(rows, response_length), scores=np.zeros(rows, np.float32),
                    prompt_routes=routes(prompt_length), response_routes=routes(response_length))
    batch = RolloutBatch.of_groups(groups, 0, routes=route_shape is not None).replace(
        **{k: np.zeros((rows, response_length), np.float32) for k in self.columns()})
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), batch)
