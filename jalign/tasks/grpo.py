"""GRPO and PPO: prompts -> `rl.rollout.sample` (n per prompt) -> rewards -> advantages -> ppo_epochs x
mini-batches of clipped-surrogate updates with a KL penalty to the frozen reference policy (in the loss, or
subtracted from the reward with a fixed or adaptive coefficient). Advantages come from group baselines (GRPO,
Dr.GRPO, RLOO, REINFORCE++-baseline), discounted returns (REINFORCE++) or GAE over a learned critic (PPO; the critic
has its own optimizer and is updated on the same mini-batches). Online, or offline from a replay buffer.

An objective of the shared loop (`train.loop`): it owns resume, checkpoints (the train state, the prompt iterator, and
here the critic, the KL coefficient and the learning-rate scale), metrics, the non-finite policy, evaluation,
preemption and export; this task builds the rollout stage and the update, and runs one step at a time.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import parallel
from jalign.config import RunConfig
from jalign.core.errors import ConfigError
from jalign.data.sources import open_source
from jalign.eval.policy import accuracy
from jalign.losses import advantages as adv_lib
from jalign.losses import policy as policy_lib
from jalign.models.sharding import to_host
from jalign.objectives import grpo as objective
from jalign.rewards.verifiable import NEEDS_GROUND_TRUTH
from jalign.rl.batch import RolloutBatch
from jalign.rl.config import check_policy
from jalign.rl.groups import Groups, minibatches
from jalign.rl.monitors import Monitors
from jalign.rl.plan import LogprobPlan
from jalign.rl.stage import RolloutStage, advantages, logprob_agreement
from jalign.tasks.critic import Critic
from jalign.tasks.grpo_sampler import StepSampler, rollout_metrics
from jalign.train import loop
from jalign.train import optimizer as optim_lib
from jalign.train.task import Setup, StepOut, Task, global_from_full


class GrpoTask(Task):
  defer_metrics = False  # a step's metrics are on the host already: its rewards and the update's sums

  def __init__(self, cfg: RunConfig):
    super().__init__(cfg)
    g, s = cfg.grpo, cfg.sampling
    self.rows = g.prompts_per_step * s.num_samples
    # Mini-batches are drawn as whole groups (each prompt's samples together, in order, as verl splits its rollout),
    # so the update can run each prompt once per group.
    self.group_size = s.num_samples if g.share_prompts and g.prompts_per_step % g.mini_batches == 0 else 0
    kl = cfg.kl
    self.loss_cfg = cfg.policy_loss.loss_config(
        kl_coef=0.0 if kl.in_reward else kl.coef, kl_kind=kl.kind, temperature=s.temperature,
        group_size=self.group_size, norm_rows=self.rows // g.mini_batches,
        router_loss=dataclasses.replace(self.router_loss(), rl=True))
    self.plan = LogprobPlan.of(cfg)

  def build(self, setup: Setup, optimizer, schedule):
    cfg, g, s = self.cfg, self.cfg.grpo, self.cfg.sampling
    self.setup = setup
    mesh, tok, graphdef = setup.mesh, setup.tok, setup.graphdef
    self.rewards = cfg.reward.spec()
    model_reward = None
    if cfg.reward.model:
      from jalign.rewards.learned import ModelReward
      model_reward = ModelReward(cfg.reward.model, cfg.reward.model_weight, setup.rollout_mesh or mesh,
                                 cfg.mesh.rules)
    self.spec = s
    self.metric = next((n for n, _ in self.rewards.weights if n in NEEDS_GROUND_TRUTH), None)
    max_prompt = min(s.max_prompt_length, setup.model_cfg.max_position_embeddings - s.max_new_tokens)
    if g.async_staleness and setup.rollout_mesh is None and jax.process_count() > 1:
      # Each process would enqueue the generation thread's programs and the update's in its own order on the same
      # devices, and their collectives would pair up wrongly across processes.
      raise ConfigError(f"config.grpo.async_staleness={g.async_staleness} on {jax.process_count()} processes needs "
                        "sampling on devices of its own: set grpo.rollout_mesh (e.g. (P, 1, 1) for P processes, "
                        "one device each set apart), or async_staleness=0")
    check_policy(g, setup.model_cfg)
    self.sample_mesh = setup.rollout_mesh or mesh  # sampling's devices: the training mesh's, or set apart
    self.stage = RolloutStage(g, s, cfg.env, tok, self.rewards, remax=cfg.advantage.estimator == "remax",
                              fields=cfg.data.fields(), max_prompt=max_prompt, model_cfg=setup.model_cfg, mesh=self.sample_mesh,
                              rules=s.rules(cfg.mesh.rules), model_reward=model_reward,
                              check_records=cfg.data.check_records)
    self.eval_prompts = []
    if g.eval_prompts and self.metric:
      eval_source = open_source(g.eval_prompts, cfg.data.fields())
      self.eval_prompts = [self.stage.encode(eval_source[i], index=i, where=eval_source.where(i))
                           for i in range(min(len(eval_source), g.eval_examples))]
      self.eval_records = [eval_source[i] for i in range(min(len(eval_source), g.eval_examples))]

    # grpo.compact_sizes: the update batch holds the informative groups only, padded to a multiple of `compact_unit`.
    self.compact_unit = g.prompts_per_step // g.compact_sizes if g.compact_sizes else 0
    self.batch_sharding = parallel.batch_sharding(mesh)
    self.rep = parallel.replicated(mesh)
    # A mini-batch's rows, taken in one compiled program: eager indexing of a global array runs several small
    # programs per column, and two processes could enter them in different orders and wait on each other.
    self.take_rows = jax.jit(lambda batch, rows_R: jax.tree.map(lambda v: v[rows_R], batch),
                             out_shardings=self.batch_sharding)
    self.lr_scale = 1.0
    self.updates = {}  # mini-batch rows -> jitted update at the current lr_scale
    logprobs_fn = lambda params, batch: objective.response_logprobs(  # noqa: E731
        graphdef, params, batch, s.temperature, cfg.logprobs, self.group_size)[0]
    self.logprobs = jax.jit(logprobs_fn)
    # Sampling filtered its distribution (top-k / top-p / min-p): the behaviour log-probs are over the kept set, so
    # the trainer's side of a rollout correction and of the agreement metric is renormalised over the same set.
    self.filtered = bool(s.top_k or s.top_p < 1 or s.min_p > 0)
    self.kept_logprobs = jax.jit(lambda params, batch: objective.kept_logprobs(
        graphdef, params, batch, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
        group_size=self.group_size), out_shardings=self.batch_sharding)  # lax.map's result would be replicated
    self.routing_mismatch = jax.jit(lambda params, batch, routes: objective.routing_mismatch(
        graphdef, params, batch, routes, replay=g.routing_replay, group_size=self.group_size))
    self.reference, self.ref_logprobs = self.make_reference(setup, logprobs_fn)
    self.report_kl = jax.jit(lambda logp, ref_logp, mask: adv_lib.masked_mean(
        policy_lib.kl_penalty(logp, ref_logp, cfg.kl.kind), mask.astype(jnp.float32)), out_shardings=self.rep)
    self.critic = Critic(cfg, nnx.merge(graphdef, setup.full(setup.state.params)), mesh,
                         self.rows // g.mini_batches) if cfg.advantage.estimator == "gae" else None
    kl = cfg.kl
    self.kl_ctl = policy_lib.AdaptiveKL(kl.coef, kl.target, kl.horizon) if kl.ctrl == "adaptive" else None
    self.key = jax.random.key(cfg.seed)
    self.monitors = Monitors(entropy_floor=g.entropy_floor, no_signal_warn_steps=g.no_signal_warn_steps)
    self.initial = {}  # the initial policy's held-out accuracies
    self.step = 0
    self.last: dict = {}
    self.sampler = StepSampler(cfg, self.stage, graphdef, self.sample_mesh, setup.rollout_mesh)
    return self.sampler.iterator

  def rollout_mesh_shape(self) -> tuple:
    return tuple(self.cfg.grpo.rollout_mesh)

  def make_reference(self, setup: Setup, logprobs_fn):
    """(reference params, jitted (params, batch) -> its log-probs [N, R] of the responses): the initial policy."""
    reference = setup.reference()
    fetched = self.cfg.model.offload_reference  # its forward copies it to the device first
    return reference, jax.jit(parallel.fetching(logprobs_fn, reference)) if fetched else self.logprobs

  # The update, as the run and the fit check build it ------------------------------------------------------------
  def micro_batches(self) -> int:
    return 1  # a mini-batch is one update

  def make_loss_fn(self, graphdef, rows: int = 0):
    """The policy loss over mini-batches of `rows` rows (0: a full mini-batch of the step)."""
    rows = rows or self.rows // self.cfg.grpo.mini_batches
    return objective.make_loss_fn(graphdef, dataclasses.replace(self.loss_cfg, global_rows=rows), self.cfg.logprobs)

  def update_optimizer(self, lr_scale: float = 1.0):
    """The update's optimizer at `lr_scale` x the configured learning rate (the optimizer state's structure does not
    depend on it, so lowering it mid-run only recompiles), its schedule counting updates_per_step per step."""
    cfg = self.cfg
    return optim_lib.make(dataclasses.replace(cfg.optim, lr=cfg.optim.lr * lr_scale), cfg.train.steps,
                          cfg.grpo.updates_per_step)

  def abstract_batch(self, model_cfg=None) -> RolloutBatch:
    """A mini-batch's shapes: whole groups when they share their prompt, else rows of any prompts (a mini-batch may
    then hold fewer rows than a group); with routing replay, the routes of `model_cfg`'s layers."""
    s, g = self.cfg.sampling, self.cfg.grpo
    route_shape = (len(model_cfg.moe_layers), model_cfg.experts_per_token) if g.routing_replay else None
    return self.plan.abstract_batch(self.rows // g.mini_batches, self.group_size or 1, s.max_prompt_length,
                                    s.max_new_tokens, route_shape)

  def _update_fn(self, mini_batch_rows: int):
    """The jitted policy update at `lr_scale` for mini-batches of `mini_batch_rows` rows."""
    if mini_batch_rows not in self.updates:
      s = self.setup
      jitted = self.jit_update(s.mesh, s.trainable(), *self.update_optimizer(self.lr_scale), rows=mini_batch_rows)
      self.updates[mini_batch_rows] = lambda state, batch: jitted(state, batch, s.frozen)
    return self.updates[mini_batch_rows]

  def extra_state(self):
    extra = {}
    if self.critic is not None:
      extra["critic"] = self.critic.state
    if self.kl_ctl is not None:
      extra["kl_coef"] = jax.device_put(jnp.asarray(self.kl_ctl.value, jnp.float32), self.rep)
    if self.cfg.kl.max_action == "lower_lr":
      extra["lr_scale"] = jax.device_put(jnp.asarray(self.lr_scale, jnp.float32), self.rep)
    return extra or None

  def load_extra_state(self, extra) -> None:
    if self.critic is not None:
      self.critic.state = extra["critic"]
    if self.kl_ctl is not None:
      self.kl_ctl.value = float(extra["kl_coef"])
    if "lr_scale" in extra:
      self.lr_scale = float(extra["lr_scale"])
      self.updates.clear()

  def where(self, records) -> list[str]:
    return list(records)

  def _policy(self, params):
    return nnx.merge(self.setup.graphdef, params)

  def begin(self, state, start: int) -> None:
    """The held-out accuracy of the initial policy (the reference, also on resume), written at `start`."""
    self.step = start
    if self.setup.rollout_mesh is not None:
      ids = lambda m: ",".join(str(d.id) for d in m.devices.flat)  # noqa: E731
      self.say(f"sampling on a mesh of its own {dict(self.sample_mesh.shape)} over devices {ids(self.sample_mesh)}; "
               f"training on devices {ids(self.setup.mesh)}")
    if not self.eval_prompts:
      return
    on_device = parallel.in_memory(self.reference, "device") if self.cfg.model.offload_reference else self.reference
    self.initial = self._accuracies(self._policy(on_device))
    del on_device
    self.say(f"held-out {self.metric} accuracy of the initial policy: {self._describe(self.initial)}")
    self.log.write(start, self.initial)
    self.monitors.after_eval(start, self.initial["eval/accuracy"], len(self.eval_prompts))

  def _accuracies(self, lm) -> dict:
    """Greedy held-out accuracy: of one answer, or of whole episodes (and then, for an environment with tools, of
    one answer without them: eval/accuracy_no_tools)."""
    if self.stage.make_env is None:
      return {"eval/accuracy": accuracy(lm, self.setup.tok, self.eval_prompts, self.metric,
                                        self.cfg.sampling.max_new_tokens)}
    return self.stage.episode_accuracies(lm, self.eval_records, jax.random.key(self.cfg.seed))

  @staticmethod
  def _describe(accs: dict) -> str:
    text = f"{accs['eval/accuracy']:.4f}"
    if "eval/accuracy_no_tools" in accs:
      text += f" with tools, {accs['eval/accuracy_no_tools']:.4f} without"
    return text

  def evaluate(self, setup, params) -> dict:
    if not self.eval_prompts:
      return {}
    accs = self._accuracies(self._policy(params))
    signals, warnings = self.monitors.after_eval(self.step, accs["eval/accuracy"], len(self.eval_prompts))
    for line in warnings:
      self.say(f"warning: {line}")
    return {**accs, **{f"{k}_initial": v for k, v in self.initial.items()}, **signals}

  def eval_message(self, step: int, metrics: dict, final: bool) -> str:
    kl = self.last.get("actor/kl_loss", 0.0)
    now = {k: metrics[k] for k in self.initial}
    if final:
      acc = now["eval/accuracy"]
      return (f"held-out {self.metric} accuracy: {self._describe(self.initial)} -> {self._describe(now)} "
              f"({(acc - self.initial['eval/accuracy']) * 100:+.1f} points); KL to reference {kl:.4f}")
    return f"step {step}: held-out {self.metric} accuracy {self._describe(now)}  KL to reference {kl:.4f}"

  def host_state(self):
    return self.sampler.host_state()

  def load_host_state(self, obj) -> None:
    self.sampler.load_host_state(obj)

  def train_step(self, state, step: int):
    """rollout -> update batch -> its log-prob columns (`self.plan`) -> advantages -> ppo_epochs x mini-batch
    updates -> metrics."""
    cfg, g, kl = self.cfg, self.cfg.grpo, self.cfg.kl
    self.step = step
    t0 = time.perf_counter()
    rollout, waited = self.sampler.rollout(self.setup.full(state.params), step)
    if self.log is not None and self.log.wants_samples(step):
      self.log.samples(step, rollout.sampled.shown(self.setup.tok, cfg.log.samples))
    trained = self._compacted(rollout.sampled)
    logs = step % cfg.train.log_every == 0 or step == cfg.train.steps
    evals = bool(cfg.train.eval_every and step % cfg.train.eval_every == 0 and self.eval_prompts)
    params = self.setup.full(state.params)
    batch, kl_pair, agreement = self._batch(params, trained, report_kl=logs or evals, agree=logs)
    kl_coef = self.kl_ctl.value if self.kl_ctl is not None else kl.coef
    batch, adv_metrics, no_signal = self.advantages(batch, trained, kl_coef)
    skip_update = no_signal and g.no_signal == "skip" and self.critic is None  # a critic still learns the returns
    if self.plan.reference and not kl.in_reward and not skip_update:  # only the loss's KL term reads it
      batch = batch.replace(ref_logp=self.ref_logprobs(self.reference, batch))
    kl_to_ref = None if kl_pair is None else float(self.report_kl(*kl_pair, batch.response_mask))
    if self.kl_ctl is not None:  # kept in float32, as checkpointed, so a resumed run continues bitwise
      self.kl_ctl.value = float(np.float32(self.kl_ctl.update(adv_metrics["actor/reward_kl"], self.rows)))
    t1 = time.perf_counter()
    state, metrics = self._update(state, batch, step, epochs=0 if skip_update else g.ppo_epochs)
    metrics.update(adv_metrics)
    metrics["actor/no_signal"] = float(no_signal)
    if no_signal and logs:
      signal = rollout.sampled.informative()
      self.say(f"step {step}: no signal this step ({int(signal.sum())} of {len(signal)} groups have rewards that "
               "differ; every advantage is 0)" + ("; update skipped" if skip_update else ""))
    if kl_to_ref is not None:
      metrics["actor/kl_loss"] = kl_to_ref
    metrics.update(agreement)
    if self.kl_ctl is not None or kl.in_reward:
      metrics["actor/kl_coef"] = kl_coef
    metrics.update(rollout_metrics(rollout, trained, waited, t0, t1,
                                   trains=step - 1 if g.async_staleness else None))
    self._monitor(step, metrics, trained, no_signal)
    return state, StepOut(metrics, records=[p.where for p in trained.prompts])

  def advantages(self, batch: RolloutBatch, trained: Groups, kl_coef: float):
    """(batch with its advantages, metrics, whether every advantage is 0): `rl.stage.advantages`."""
    cfg, kl = self.cfg, self.cfg.kl
    return advantages(cfg.advantage, batch, trained, critic=self.critic,
                      reward_kl=(kl.kind, kl_coef) if kl.in_reward else None,
                      dynamic_sampling=cfg.grpo.dynamic_sampling, sharding=self.batch_sharding)

  def _compacted(self, sampled: Groups) -> Groups:
    """grpo.compact_sizes: the groups the loss would mask left out (the same loss for less work)."""
    if not self.compact_unit:
      return sampled
    kept = -(-int(sampled.informative().sum()) // self.compact_unit) * self.compact_unit
    return Groups.select([sampled], max(kept, self.compact_unit))

  def _batch(self, params, trained: Groups, *, report_kl: bool, agree: bool):
    """The update batch of `trained` on the devices with the log-prob columns of `self.plan` (the reference's only
    where the advantages need it); (policy, reference) log-probs to report the KL with on a step where the reference
    does not run anyway (`report_kl`), else None; and with `agree`, the agreement of the sampler's log-probs with the
    trainer's."""
    plan = self.plan
    rows = self.update_rows(trained)
    response_mask = rows.response_mask
    # Offline or asynchronous: the ratio is against the stored behaviour log-probs, or (a rollout correction) against
    # the policy before the update, the behaviour log-probs then weighting it.
    if plan.stored:
      rows = rows.replace(**{plan.stored: trained.behaviour})
    batch = global_from_full(rows, self.batch_sharding)
    if plan.current_old:
      batch = batch.replace(old_logp=self.logprobs(params, batch))
    kl_pair = None
    if plan.reference and self.cfg.kl.in_reward:  # the rewards subtract the KL: the advantages need it
      batch = batch.replace(ref_logp=self.ref_logprobs(self.reference, batch))
    elif not plan.reference and report_kl:  # the policy's log-probs before the update, as the loss sees them
      current = batch.old_logp if plan.current_old else self.logprobs(params, batch)
      kl_pair = (current, self.ref_logprobs(self.reference, batch))
    rollout_logp = trained.behaviour if trained.behaviour is not None else trained.sampler_logp
    kept_logp = None
    if self.filtered and rollout_logp is not None and (plan.kept or agree):
      kept_logp = self.kept_logprobs(params, batch)
      if plan.kept:
        batch = batch.replace(kept_logp=kept_logp)
    agreement = {}
    if agree and rollout_logp is not None:  # the sampler's log-probs against the trainer's, same tokens and weights
      current = kept_logp if kept_logp is not None else batch.old_logp if plan.current_old else \
          kl_pair[0] if kl_pair is not None else self.logprobs(params, batch)
      agreement = logprob_agreement(rollout_logp, to_host(current), response_mask)
    if agree and trained.prompt_routes is not None:  # the sampler's experts against the trainer's router
      routes = batch.routes if batch.routes is not None else global_from_full(RolloutBatch.of_groups(
          trained, self.setup.tok.pad_id, routes=True).routes, self.batch_sharding)
      missed, choices = self.routing_mismatch(params, batch, routes)
      agreement["rollout/routing_mismatch"] = float(missed) / max(float(choices), 1.0)
    return batch, kl_pair, agreement

  def update_rows(self, trained: Groups) -> RolloutBatch:
    """The model rows of the update batch, on the host (`RolloutBatch.of_groups`; routing replay: their routes)."""
    return RolloutBatch.of_groups(trained, self.setup.tok.pad_id, routes=self.cfg.grpo.routing_replay)

  def _monitor(self, step: int, metrics: dict, trained: Groups, no_signal: bool) -> None:
    """The run's monitors (their signals into `metrics`, their warnings said) and kl.max."""
    example = trained.example(self.setup.tok, self.rewards.weights) if no_signal else ""
    signals, warnings = self.monitors.after_step(step, metrics, example)
    metrics.update(signals)
    for line in warnings:
      self.say(f"warning: {line}")
    self._kl_bound(step, metrics.get("actor/kl_loss", 0.0))
    self.last = metrics

  def _update(self, state, device_batch: RolloutBatch, step: int, epochs: int):
    """`epochs` passes of shuffled mini-batches through the policy update (and the critic's); the metrics averaged
    over the updates (the skip counts as they stand)."""
    g = self.cfg.grpo
    sums: dict[str, float] = {}
    order_key = jax.random.fold_in(jax.random.fold_in(self.key, step - 1), 1)
    for epoch in range(epochs):
      for chunk in minibatches(jax.random.fold_in(order_key, epoch), device_batch.rows, g.mini_batches,
                               self.group_size):
        mb = device_batch if g.mini_batches == 1 else self.take_rows(
            device_batch, jax.device_put(np.asarray(chunk, np.int32), self.rep))
        m = {}
        if self.critic is None or step - 1 >= self.cfg.critic.warmup:
          state, m = self._update_fn(mb.rows)(state, mb)
        if self.critic is not None:
          m = {**m, **self.critic.update(mb)}
        for k, v in jax.device_get(m).items():
          sums[k] = float(v) if k.endswith("skipped_nonfinite") else sums.get(k, 0.0) + float(v)  # counts
    metrics = {k.replace("train/loss", "actor/loss"): v if k.endswith("skipped_nonfinite") else v / g.updates_per_step
               for k, v in sums.items()}
    return state, metrics

  def _kl_bound(self, step: int, kl: float) -> None:
    """kl.max: past it, lower the learning rate for the next steps or end the run here."""
    bound = self.cfg.kl
    if not bound.max or kl <= bound.max:
      return
    if bound.max_action == "lower_lr":
      self.lr_scale = float(np.float32(self.lr_scale * bound.lr_factor))
      self.updates.clear()
      self.say(f"step {step}: KL to the reference {kl:.4f} exceeds kl.max={bound.max}; learning rate lowered "
               f"to {self.lr_scale:g} x optim.lr")
      self.log.write(step, {"monitor/lr_scale": self.lr_scale})
    else:
      self.stop_reason = f"KL to the reference {kl:.4f} exceeds kl.max={bound.max}"


def task(cfg: RunConfig) -> GrpoTask:
  return GrpoTask(cfg)


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, task(cfg))
