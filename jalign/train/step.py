"""The pure train step: gradient accumulation as a lax.scan over micro-batches, one optimizer update.

An objective supplies `loss_fn(params, batch) -> (loss_sum, weight, metric_sums)`; the step divides by the weight
summed over the whole global batch (all micro-batches and data-parallel shards), so accumulation and data
parallelism give the same update as one big batch.

A non-finite loss or gradient norm is caught in the step itself: the update is not applied (parameters and
optimizer state stay as they were), `train/nonfinite` is 1 and the state's `skipped` count (checkpointed, reported
as `train/skipped_nonfinite`) goes up, read back with the other metrics (no extra host sync). The loop then skips
on or stops (`train.nonfinite`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jalign import models, parallel
from jalign.models import lora


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  skipped: jax.Array  # updates not applied because the loss or gradient was non-finite (checkpointed with the rest)

  @staticmethod
  def begin(params: Any, opt_state: Any, rep) -> "TrainState":
    """Step 0, nothing skipped; `rep` is the replicated sharding of the two scalars."""
    zero = lambda: jax.device_put(jnp.zeros((), jnp.int32), rep)  # noqa: E731
    return TrainState(zero(), params, opt_state, zero())


LossFn = Callable[[Any, dict], tuple[jax.Array, jax.Array, dict]]


def make_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, lr_schedule, micro_batches: int,
              micro_sharding=None, *, dropout_seed: int | None = None, combine=lora.combine):
  """(state, batch, frozen=None) -> (state, metrics); batch: a dict of columns or a pytree of them (GRPO / PPO's
  `rl.batch.RolloutBatch`, with a `replace` method), its leaves [global_batch, ...].

  `frozen`: parameters that take part in the loss but do not train (a LoRA run's base weights, a distillation
  teacher); the loss sees `combine(state.params, frozen)` (by default `lora.combine`: the whole parameter dict) and
  only `state.params` get gradients and optimizer state.
  `dropout_seed`: each micro-batch gets a `dropout_rng` key (from the seed, the step and the micro-batch index),
  which objectives pass to the model's forward."""

  def step(state: TrainState, batch, frozen=None):
    micro = jax.tree.map(lambda x: x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:]), batch)
    if micro_sharding is not None:
      micro = jax.lax.with_sharding_constraint(micro, micro_sharding)
    if dropout_seed is not None:
      keys = jax.random.split(jax.random.fold_in(jax.random.key(dropout_seed), state.step), micro_batches)
      micro = {**micro, "dropout_rng": keys} if isinstance(micro, dict) else micro.replace(dropout_rng=keys)
    whole = functools.partial(combine, frozen=frozen)

    def accumulate(carry, mb):
      grads, loss_sum, weight, sums = carry
      (l, (w, s)), g = jax.value_and_grad(lambda p: _split(loss_fn(whole(p), mb)), has_aux=True)(state.params)
      return (jax.tree.map(jnp.add, grads, g), loss_sum + l, weight + w, jax.tree.map(jnp.add, sums, s)), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    _, (_, metric_shapes) = jax.eval_shape(
        lambda: _split(loss_fn(whole(state.params), jax.tree.map(lambda x: x[0], micro))))
    init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
            jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), metric_shapes))
    (grads, loss_sum, weight, sums), _ = jax.lax.scan(accumulate, init, micro)
    denom = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    params = jax.tree.map(keep, params, state.params)
    opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    skipped = state.skipped + (~finite).astype(jnp.int32)
    metrics = {"train/loss": loss_sum / denom, "train/grad_norm": grad_norm,
               "train/nonfinite": 1.0 - finite.astype(jnp.float32), "train/skipped_nonfinite": skipped,
               "train/lr": lr_schedule(state.step), "train/weight": weight,
               **{k: v / denom for k, v in sums.items()}}
    return TrainState(state.step + 1, params, opt_state, skipped), metrics

  return step


def _split(out):
  loss_sum, weight, sums = out
  return loss_sum, (weight.astype(jnp.float32), sums)


@dataclasses.dataclass
class Trainable:
  """A module split for training on a mesh: what `jit_step` and the checkpointer need."""
  graphdef: Any
  state: TrainState
  state_shardings: Any
  frozen: Any = None             # with LoRA adapters: the base weights, beside the trainable `state.params`
  frozen_shardings: Any = None


def trainable(module: nnx.Module, optimizer, mesh, rules) -> Trainable:
  """The one train-state builder (policy, reward model and critic): parameters placed by the logical-axis `rules`
  (parts built outside a loader, such as heads, land on the mesh too), the base weights set apart as frozen when the
  module has LoRA adapters, the optimizer state initialised in its own shardings."""
  graphdef, params = nnx.split(module)
  params = nnx.to_pure_dict(params)
  param_shardings = nnx.to_pure_dict(models.state_shardings(module, mesh, rules))
  params = jax.device_put(params, param_shardings)
  frozen = frozen_shardings = None
  if lora.has_adapters(params):  # only the adapters (and a head) train; the base rides along, frozen
    params, frozen = lora.partition(params)
    param_shardings, frozen_shardings = lora.partition(param_shardings)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt_shardings = parallel.optimizer_shardings(optimizer, param_shardings, abstract, mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  rep = parallel.replicated(mesh)
  return Trainable(graphdef, TrainState.begin(params, opt_state, rep),
                   TrainState(rep, param_shardings, opt_shardings, rep), frozen, frozen_shardings)


def jit_step(loss_fn, optimizer, schedule, micro_batches: int, mesh, t: Trainable, *, dropout_seed=None,
             combine=lora.combine):
  """The one jitted train step: (state, batch, frozen) -> (state, metrics), the state donated; `frozen` laid out as
  `t.frozen_shardings`."""
  step_fn = make_step(loss_fn, optimizer, schedule, micro_batches,
                      parallel.batch_sharding(mesh, leading_micro_axis=True), dropout_seed=dropout_seed,
                      combine=combine)
  return jax.jit(step_fn, in_shardings=(t.state_shardings, parallel.batch_sharding(mesh), t.frozen_shardings),
                 out_shardings=(t.state_shardings, parallel.replicated(mesh)), donate_argnums=0)
