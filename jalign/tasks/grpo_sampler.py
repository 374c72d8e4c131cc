"""GRPO / PPO's groups for each step: sampled when the step needs them by the current policy, or up to
`grpo.async_staleness` steps ahead in a generation thread by the policy of the time; on the training devices or on a
mesh of their own (`grpo.rollout_mesh`). The rollouts sampled ahead are checkpointed, so a resumed run trains on the
same ones."""
from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.config import RunConfig
from jalign.models.sharding import state_shardings, to_host
from jalign.rl.agentic.agent import summary as agent_summary
from jalign.rl.groups import Groups
from jalign.rl.stage import RolloutStage


@dataclasses.dataclass
class Rollout:
  """A step's sampled groups, the generation batches they took, the policy version that sampled them (updates
  applied before) and the seconds sampling took."""
  sampled: Groups
  batches: int
  version: int
  seconds: float


class StepSampler:
  def __init__(self, cfg: RunConfig, stage: RolloutStage, graphdef, sample_mesh, rollout_mesh):
    self.cfg, self.stage, self.graphdef = cfg, stage, graphdef
    self.sample_mesh = sample_mesh    # sampling's devices: the training mesh's, or `rollout_mesh` set apart
    self.rollout_mesh = rollout_mesh
    ds = grain.MapDataset.range(len(stage)).seed(cfg.seed).shuffle().repeat(None)
    n = cfg.grpo.prompts_per_step
    # grain 0.2.18's batch(1) of an endless dataset overflows an index when iterated; one-index arrays are the same
    ds = ds.batch(n) if n > 1 else ds.map(lambda i: np.asarray([i]))
    self.iterator = iter(ds.to_iter_dataset())  # checkpointed by the loop
    self.key = jax.random.key(cfg.seed)
    self.in_flight: dict[int, Future | Rollout] = {}  # async: step -> its rollout, sampled or being sampled
    self.generator = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if cfg.grpo.async_staleness else None
    self.sample_shardings = None  # the policy's layout on the rollout mesh (set on first use)

  def rollout(self, params, step: int) -> tuple[Rollout, float]:
    """Step `step`'s rollout and the seconds spent waiting for it; `params`: the policy now (whole). Synchronous:
    sampled now by it. With async_staleness k: first the rollouts up to step + k are submitted to the generation
    thread (each by the policy as it is now, version step - 1), then this step's, submitted k steps ago, is
    awaited."""
    k = self.cfg.grpo.async_staleness
    if not k:
      return self._generate(self._for_sampling(params), step, step - 1), 0.0
    snapshot = None
    for later in range(step, min(step + k, self.cfg.train.steps) + 1):
      if later not in self.in_flight:
        if snapshot is None:
          snapshot = self._for_sampling(params)
        self.in_flight[later] = self.generator.submit(self._generate, snapshot, later, step - 1)
    t0 = time.perf_counter()
    rollout = self.in_flight.pop(step)
    return (rollout.result() if isinstance(rollout, Future) else rollout), time.perf_counter() - t0

  def _generate(self, params, step: int, version: int) -> Rollout:
    """Step `step`'s groups, sampled by the policy `params` (after `version` updates)."""
    g = self.cfg.grpo
    t0 = time.perf_counter()
    step_key = jax.random.fold_in(self.key, step - 1)
    lm = nnx.merge(self.graphdef, params)
    with jax.set_mesh(self.sample_mesh):  # also in the generation thread (the mesh is a per-thread setting)
      batches = [self.stage.collect(lm, next(self.iterator), step_key)]
      while (g.dynamic_sampling and len(batches) < g.max_gen_batches
             and sum(int(b.informative().sum()) for b in batches) < g.prompts_per_step):
        # DAPO: refill until prompts_per_step groups carry signal (verl filter_groups)
        batches.append(self.stage.collect(lm, next(self.iterator), jax.random.fold_in(step_key, len(batches) + 1)))
    sampled = Groups.select(batches, g.prompts_per_step) if len(batches) > 1 else batches[0]
    if g.async_staleness:  # sampled by an older policy: its log-probs are the behaviour policy's
      sampled = dataclasses.replace(sampled, behaviour=sampled.sampler_logp)
    return Rollout(sampled, len(batches), version, time.perf_counter() - t0)

  def _for_sampling(self, params):
    """The policy as sampling reads it: copied to the rollout mesh in sampling's layout where there is one (the
    sampler's own re-layout then finds it in place); else on the training devices, copied when the generation
    thread reads it (the update donates the state's buffers)."""
    if self.rollout_mesh is None:
      return jax.tree.map(jnp.copy, params) if self.cfg.grpo.async_staleness else params
    if self.sample_shardings is None:
      self.sample_shardings = nnx.to_pure_dict(state_shardings(nnx.merge(self.graphdef, params), self.sample_mesh,
                                                               self.stage.rules or self.cfg.mesh.rules))
    if jax.process_count() > 1:  # across processes, disjoint device sets are bridged through each host's memory
      params = to_host(params)
    return jax.device_put(params, self.sample_shardings)

  def host_state(self):
    """The rollouts sampled for the next steps (async)."""
    if not self.cfg.grpo.async_staleness:
      return None
    done = {s: r.result() if isinstance(r, Future) else r for s, r in self.in_flight.items()}
    self.in_flight = dict(done)
    return {str(s): {"groups": r.sampled.to_json(), "batches": r.batches, "version": r.version,
                     "seconds": r.seconds} for s, r in sorted(done.items())}

  def load_host_state(self, obj) -> None:
    self.in_flight = {int(s): Rollout(Groups.from_json(r["groups"]), r["batches"], r["version"], r["seconds"])
                      for s, r in obj.items()}


def rollout_metrics(rollout: Rollout, trained: Groups, waited: float, t0: float, t1: float, *,
                    lag: int | None) -> dict:
  """A step's rollout metrics: scores, lengths, the groups updated on, timings (`t0`: the step's start, `t1`: the
  update's) and, asynchronous (`lag`: the sampling policy's updates behind), the lag and the wait."""
  sampled, out = rollout.sampled, {}
  if sampled.rm_scores is not None:
    out["critic/rm_score/mean"] = float(np.mean(sampled.rm_scores))
  if sampled.counts is not None:
    out.update(agent_summary(sampled.counts, sampled.lengths))
  out.update({"critic/score/mean": float(np.mean(sampled.scores)),
              "response_length/mean": float(np.mean(sampled.lengths)),
              "actor/informative_groups": float(np.mean(sampled.informative())),
              "timing_s/gen": rollout.seconds, "timing_s/update": time.perf_counter() - t1,
              "timing_s/step": time.perf_counter() - t0, "actor/gen_batches": rollout.batches,
              "actor/update_groups": len(trained.prompts)})
  if lag is not None:
    out.update({"rollout/policy_lag": float(lag), "timing_s/gen_wait": waited})
  return out
