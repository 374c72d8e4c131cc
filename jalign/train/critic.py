"""PPO's critic at train time: its own parameters, optimizer (and learning rate) and jitted value / update steps,
laid out on the policy's mesh with the same rules."""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from jalign import models, parallel
from jalign.config import RunConfig
from jalign.models import lora
from jalign.objectives import ppo
from jalign.train import optimizer as optim_lib
from jalign.train.step import TrainState, make_step


class Critic:
  def __init__(self, cfg: RunConfig, policy_lm: models.Decoder, mesh, global_rows: int):
    g = cfg.grpo
    module = ppo.make_critic(policy_lm, seed=cfg.seed + 1)
    self.graphdef, params = nnx.split(module)
    params = nnx.to_pure_dict(params)
    param_shardings = nnx.to_pure_dict(models.state_shardings(module, mesh, cfg.mesh.rules))
    params = jax.device_put(params, param_shardings)
    self.frozen = frozen_shardings = None
    if lora.has_adapters(params):  # adapters and head train; the base (shared with the policy) stays frozen
      params, self.frozen = lora.partition(params)
      param_shardings, frozen_shardings = lora.partition(param_shardings)
    optimizer, schedule = optim_lib.make(dataclasses.replace(cfg.optim, lr=g.critic_lr), cfg.train.steps,
                                         g.updates_per_step)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    opt_shardings = parallel.optimizer_shardings(optimizer, param_shardings, abstract, mesh)
    rep = parallel.replicated(mesh)
    self.state = TrainState.begin(params, jax.jit(optimizer.init, out_shardings=opt_shardings)(params), rep)
    shardings = TrainState(rep, param_shardings, opt_shardings, rep)
    batch_sharding = parallel.batch_sharding(mesh)
    loss = ppo.make_value_loss_fn(self.graphdef, ppo.ValueLossConfig(clip=g.value_clip, agg=g.agg,
                                                                      global_rows=global_rows,
                                                                      horizon=g.loss_scale_factor))
    step = make_step(loss, optimizer, schedule, 1, parallel.batch_sharding(mesh, leading_micro_axis=True))
    self._update = jax.jit(step, in_shardings=(shardings, batch_sharding, frozen_shardings),
                           out_shardings=(shardings, rep), donate_argnums=0)
    self._values = jax.jit(lambda params, batch: ppo.response_values(self.graphdef, params, batch))

  def values(self, batch: dict) -> jax.Array:
    return self._values(lora.combine(self.state.params, self.frozen), batch)

  def update(self, batch: dict) -> dict:
    self.state, metrics = self._update(self.state, batch, self.frozen)
    return {k.replace("train/", "critic/"): v for k, v in metrics.items() if k not in ("train/loss", "train/weight")}
