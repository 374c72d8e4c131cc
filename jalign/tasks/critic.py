"""PPO's critic at train time: its own parameters, optimizer (and learning rate) and jitted value / update steps,
laid out on the policy's mesh with the same rules."""
from __future__ import annotations

import dataclasses

import jax

from jalign import models
from jalign.config import RunConfig
from jalign.models import lora
from jalign.objectives import ppo
from jalign.rl.batch import RolloutBatch
from jalign.train import optimizer as optim_lib
from jalign.train import step as step_lib


class Critic:
  def __init__(self, cfg: RunConfig, policy_lm: models.Decoder, mesh, global_rows: int):
    c, loss_cfg = cfg.critic, cfg.policy_loss
    optimizer, schedule = optim_lib.make(dataclasses.replace(cfg.optim, lr=c.lr), cfg.train.steps,
                                         cfg.grpo.updates_per_step)
    # With LoRA the adapters and the head train; the base (shared with the policy) stays frozen.
    t = step_lib.trainable(ppo.make_critic(policy_lm, seed=cfg.seed + 1), optimizer, mesh, cfg.mesh.rules)
    self.graphdef, self.state, self.frozen = t.graphdef, t.state, t.frozen
    loss = ppo.make_value_loss_fn(self.graphdef, ppo.ValueLossConfig(clip=c.value_clip, agg=loss_cfg.agg,
                                                                      global_rows=global_rows,
                                                                      horizon=loss_cfg.loss_scale_factor))
    self._update = step_lib.jit_step(loss, optimizer, schedule, 1, mesh, t)
    self._values = jax.jit(lambda params, batch: ppo.response_values(self.graphdef, params, batch))

  def values(self, batch: RolloutBatch) -> jax.Array:
    return self._values(lora.combine(self.state.params, self.frozen), batch)

  def update(self, batch: RolloutBatch) -> dict:
    self.state, metrics = self._update(self.state, batch, self.frozen)
    return {k.replace("train/", "critic/"): v for k, v in metrics.items() if k not in ("train/loss", "train/weight")}
