"""GRPO / PPO's groups for each step: sampled when the step needs them by the current policy, or up to
`grpo.async_staleness` steps ahead in a generation thread by the policy of the time (with `grpo.partial_rollouts`, a
segment per update, each by the policy of its time); on the training devices or on a mesh of their own
(`grpo.rollout_mesh`). The rollouts sampled ahead are checkpointed, so a resumed run trains on the same ones."""
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
from jalign.core.errors import ConfigError
from jalign.models.sharding import state_shardings, to_host
from jalign.rl.agentic.agent import summary as agent_summary
from jalign.rl.groups import Groups
from jalign.rl.partial import Partial, segment_tokens
from jalign.rl.stage import RolloutStage


@dataclasses.dataclass
class Rollout:
  """A step's sampled groups (each token with the policy version that sampled it: `Groups.versions`), the
  generation batches they took and the seconds sampling took."""
  sampled: Groups
  batches: int
  seconds: float


SEGMENT_KEYS = 1 << 16  # partial rollouts: segment j draws with fold_in(step key, SEGMENT_KEYS + j)


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
    # async: step -> its rollout, sampled or being sampled (partial rollouts: or its responses so far)
    self.in_flight: dict[int, Future | Rollout | Partial] = {}
    self.finishing: set[int] = set()  # partial rollouts: the steps whose last segment is submitted
    self.generator = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if cfg.grpo.async_staleness else None
    self.sample_shardings = None  # the policy's layout on the rollout mesh (set on first use)

  def rollout(self, params, step: int) -> tuple[Rollout, float]:
    """Step `step`'s rollout and the seconds spent waiting for it; `params`: the policy now (whole). Synchronous:
    sampled now by it. With async_staleness k: first the rollouts up to step + k are submitted to the generation
    thread (each by the policy as it is now, version step - 1; partial rollouts: a segment of each, the last one
    of step + 1's), then this step's, submitted k steps ago, is awaited. No token it holds is more than k updates
    older than the policy it trains."""
    g = self.cfg.grpo
    k = g.async_staleness
    if not k:
      return self._generate(self._for_sampling(params), step, step - 1), 0.0
    snapshot = None
    for later in range(step, min(step + k, self.cfg.train.steps) + 1):
      if later in (self.finishing if g.partial_rollouts else self.in_flight):
        continue
      if snapshot is None:
        snapshot = self._for_sampling(params)
      if not g.partial_rollouts:
        self.in_flight[later] = self.generator.submit(self._generate, snapshot, later, step - 1)
        continue
      final = later <= step + 1  # it trains next: its last segment runs during this step's update
      self.in_flight[later] = self.generator.submit(self._segment, self.in_flight.get(later), snapshot, later,
                                                    step - 1, final)
      if final:
        self.finishing.add(later)
    t0 = time.perf_counter()
    rollout = self.in_flight.pop(step)
    self.finishing.discard(step)
    rollout = rollout.result() if isinstance(rollout, Future) else rollout
    oldest = int(rollout.sampled.lags(step - 1).max(initial=0))
    if oldest > k:
      raise RuntimeError(f"step {step}: a response token was sampled {oldest} updates before the policy it trains, "
                         f"beyond grpo.async_staleness={k}")
    return rollout, time.perf_counter() - t0

  def _generate(self, params, step: int, version: int) -> Rollout:
    """Step `step`'s groups, sampled by the policy `params` (after `version` updates)."""
    t0 = time.perf_counter()
    lm = nnx.merge(self.graphdef, params)
    step_key = jax.random.fold_in(self.key, step - 1)
    with jax.set_mesh(self.sample_mesh):  # also in the generation thread (the mesh is a per-thread setting)
      batches = self._refill(lm, [self.stage.collect(lm, next(self.iterator), step_key).stamped(version)], step_key,
                             version)
    return self._rollout(batches, time.perf_counter() - t0)

  def _segment(self, partial: Future | Partial | None, params, step: int, version: int, final: bool):
    """Partial rollouts: step `step`'s responses so far (None: begin them) advanced by one segment of the policy
    `params` (after `version` updates); `final`: to the end, then scored (the Rollout)."""
    partial = partial.result() if isinstance(partial, Future) else partial  # done: the thread runs jobs in order
    lm = nnx.merge(self.graphdef, params)
    step_key = jax.random.fold_in(self.key, step - 1)
    with jax.set_mesh(self.sample_mesh):
      if partial is None:
        partial = self.stage.begin(next(self.iterator))
      s = self.cfg.sampling
      limit = None if final else segment_tokens(s.max_new_tokens, self.cfg.grpo.async_staleness)
      self.stage.advance(partial, lm, jax.random.fold_in(step_key, SEGMENT_KEYS + partial.segments), version, limit)
      if not final:
        return partial
      t0 = time.perf_counter()
      batches = self._refill(lm, [self.stage.finish(partial)], step_key, version)
    return self._rollout(batches, partial.seconds + time.perf_counter() - t0)

  def _refill(self, lm, batches: list[Groups], step_key, version: int) -> list[Groups]:
    """DAPO: more batches, sampled whole by `lm`, until prompts_per_step groups carry signal (verl filter_groups)."""
    g = self.cfg.grpo
    while (g.dynamic_sampling and len(batches) < g.max_gen_batches
           and sum(int(b.informative().sum()) for b in batches) < g.prompts_per_step):
      key = jax.random.fold_in(step_key, len(batches) + 1)
      batches.append(self.stage.collect(lm, next(self.iterator), key).stamped(version))
    return batches

  def _rollout(self, batches: list[Groups], seconds: float) -> Rollout:
    g = self.cfg.grpo
    sampled = Groups.select(batches, g.prompts_per_step) if len(batches) > 1 else batches[0]
    if g.async_staleness:  # sampled by older policies: its log-probs are the behaviour policy's
      sampled = dataclasses.replace(sampled, behaviour=sampled.sampler_logp)
    return Rollout(sampled, len(batches), seconds)

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
    """The rollouts sampled for the next steps (async; partial rollouts: or their responses so far)."""
    if not self.cfg.grpo.async_staleness:
      return None
    done = {s: r.result() if isinstance(r, Future) else r for s, r in self.in_flight.items()}
    self.in_flight = dict(done)
    return {str(s): {"partial": r.to_json()} if isinstance(r, Partial) else
            {"groups": r.sampled.to_json(), "batches": r.batches, "seconds": r.seconds} for s, r in sorted(done.items())}

  def load_host_state(self, obj) -> None:
    def rollout(r):
      if "partial" in r:
        return Partial.from_json(r["partial"])
      groups = Groups.from_json(r["groups"])
      return Rollout(groups.stamped(r["version"]) if "version" in r else groups, r["batches"], r["seconds"])
    self.in_flight = {int(s): rollout(r) for s, r in obj.items()}
    self.finishing = {s for s, r in self.in_flight.items() if isinstance(r, Rollout)}
    half = sorted(s for s, r in self.in_flight.items() if isinstance(r, Partial))
    if half and not self.cfg.grpo.partial_rollouts:
      raise ConfigError(f"config.grpo.partial_rollouts=False, but the checkpoint holds the half-sampled responses of "
                        f"steps {half} (saved with partial_rollouts=True); resume with it, then change it")


def rollout_metrics(rollout: Rollout, trained: Groups, waited: float, t0: float, t1: float, *,
                    trains: int | None) -> dict:
  """A step's rollout metrics: scores, lengths, the groups updated on, timings (`t0`: the step's start, `t1`: the
  update's) and, asynchronous (`trains`: the version of the policy the update starts from), the wait and the
  response tokens' policy lag (updates behind it) as a distribution over the tokens."""
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
  if trains is not None:
    lags = sampled.lags(trains)
    out["timing_s/gen_wait"] = waited
    if lags.size:
      out.update({"rollout/policy_lag": float(lags.mean()), "rollout/policy_lag_min": float(lags.min()),
                  "rollout/policy_lag_max": float(lags.max())})
  return out
