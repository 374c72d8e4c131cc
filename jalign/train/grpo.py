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
from concurrent.futures import Future, ThreadPoolExecutor

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import parallel
from jalign.config import RunConfig
from jalign.data.sources import open_source
from jalign.errors import ConfigError
from jalign.eval.policy import accuracy
from jalign.losses import advantages as adv_lib, policy as policy_lib
from jalign.objectives import grpo as objective
from jalign.rl.agent import summary as agent_summary
from jalign.rl.groups import Groups, minibatches
from jalign.rl.monitors import Monitors
from jalign.rl.rewards import NEEDS_GROUND_TRUTH, RewardSpec
from jalign.models.sharding import state_shardings, to_host
from jalign.rl.stage import RolloutStage, advantages, logprob_agreement, update_rows
from jalign.train import loop, optimizer as optim_lib, step as step_lib
from jalign.train.critic import Critic


def _prompt_iterator(cfg: RunConfig, n: int):
  ds = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat(None)
  return iter(ds.batch(cfg.grpo.prompts_per_step).to_iter_dataset())


@dataclasses.dataclass
class Rollout:
  """A step's sampled groups, the generation batches they took, the policy version that sampled them (updates
  applied before) and the seconds sampling took."""
  sampled: Groups
  batches: int
  version: int
  seconds: float


class GrpoTask(loop.Task):
  defer_metrics = False  # a step's metrics are on the host already: its rewards and the update's sums

  def build(self, setup: loop.Setup, optimizer, schedule):
    cfg, g, s = self.cfg, self.cfg.grpo, self.cfg.sampling
    self.setup = setup
    mesh, tok, graphdef = setup.mesh, setup.tok, setup.graphdef
    self.rewards = cfg.reward.spec()
    model_reward = None
    if cfg.reward.model:
      from jalign.rl.model_reward import ModelReward
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
    self.sample_mesh = setup.rollout_mesh or mesh  # sampling's devices: the training mesh's, or set apart
    self.stage = RolloutStage(g, s, tok, self.rewards, fields=cfg.data.fields(), max_prompt=max_prompt,
                              context=setup.model_cfg.max_position_embeddings, mesh=self.sample_mesh,
                              rules=s.rules(cfg.mesh.rules), model_reward=model_reward,
                              check_records=cfg.data.check_records)
    self.eval_prompts = []
    if g.eval_prompts and self.metric:
      eval_source = open_source(g.eval_prompts, cfg.data.fields())
      self.eval_prompts = [self.stage.encode(eval_source[i], index=i, where=eval_source.where(i))
                           for i in range(min(len(eval_source), g.eval_examples))]
      self.eval_records = [eval_source[i] for i in range(min(len(eval_source), g.eval_examples))]

    self.rows = g.prompts_per_step * s.num_samples
    # Mini-batches are drawn as whole groups (each prompt's samples together, in order, as verl splits its rollout),
    # so the update can run each prompt once per group.
    self.group_size = s.num_samples if g.share_prompts and g.prompts_per_step % g.mini_batches == 0 else 0
    self.loss_cfg = objective.GrpoLossConfig(
        clip_low=g.clip_low, clip_high=g.clip_high, clip_c=g.clip_c, mode=g.loss_mode, agg=g.agg,
        kl_coef=0.0 if g.kl_in_reward else g.kl_coef, kl_kind=g.kl_kind, entropy_coef=g.entropy_coef,
        temperature=s.temperature, group_size=self.group_size, rollout_is=g.rollout_is,
        rollout_is_threshold=g.rollout_is_threshold, rollout_rs=g.rollout_rs,
        rollout_rs_threshold=g.rollout_rs_threshold, rollout_rs_threshold_lower=g.rollout_rs_threshold_lower,
        norm_rows=self.rows // g.mini_batches, tau_pos=g.tau_pos, tau_neg=g.tau_neg, horizon=g.loss_scale_factor)
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
    self.reference = setup.reference()
    self.ref_logprobs = jax.jit(parallel.fetching(logprobs_fn, self.reference)) if cfg.model.offload_reference \
        else self.logprobs
    # The reference acts through the KL coefficient only: at 0 (DAPO's recipe, no KL term) its forward runs on the
    # steps that report the KL to it, not on every step.
    self.ref_every_step = bool(g.kl_coef) or g.kl_in_reward or g.kl_ctrl == "adaptive" or bool(g.max_kl)
    self.report_kl = jax.jit(lambda logp, ref_logp, mask: adv_lib.masked_mean(
        policy_lib.kl_penalty(logp, ref_logp, g.kl_kind), mask.astype(jnp.float32)), out_shardings=self.rep)
    self.critic = Critic(cfg, nnx.merge(graphdef, setup.full(setup.state.params)), mesh,
                         self.rows // g.mini_batches) if g.adv_estimator == "gae" else None
    self.kl_ctl = policy_lib.AdaptiveKL(g.kl_coef, g.kl_target, g.kl_horizon) if g.kl_ctrl == "adaptive" else None
    self.key = jax.random.key(cfg.seed)
    self.monitors = Monitors(entropy_floor=g.entropy_floor, no_signal_warn_steps=g.no_signal_warn_steps)
    self.initial = {}  # the initial policy's held-out accuracies
    self.step = 0
    self.last: dict = {}
    self.iterator = _prompt_iterator(cfg, len(self.stage))
    self.in_flight: dict[int, Future | Rollout] = {}  # async: step -> its rollout, sampled or being sampled
    self.generator = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if g.async_staleness else None
    self.sample_shardings = None  # the policy's layout on the rollout mesh (set on first use)
    return self.iterator

  def rollout_mesh_shape(self) -> tuple:
    return tuple(self.cfg.grpo.rollout_mesh)

  def _update_fn(self, mini_batch_rows: int):
    """The jitted policy update at `lr_scale` x the configured learning rate (the optimizer state's structure does
    not depend on it, so lowering it mid-run only recompiles), for mini-batches of `mini_batch_rows` rows."""
    if mini_batch_rows not in self.updates:
      cfg, s = self.cfg, self.setup
      loss_fn = objective.make_loss_fn(s.graphdef, dataclasses.replace(self.loss_cfg, global_rows=mini_batch_rows),
                                       cfg.logprobs)
      opt, schedule = optim_lib.make(dataclasses.replace(cfg.optim, lr=cfg.optim.lr * self.lr_scale),
                                     cfg.train.steps, cfg.grpo.updates_per_step)
      jitted = step_lib.jit_step(loss_fn, opt, schedule, 1, s.mesh, s.trainable(), dropout_seed=loop.dropout_seed(cfg))
      self.updates[mini_batch_rows] = lambda state, batch: jitted(state, batch, s.frozen)
    return self.updates[mini_batch_rows]

  def extra_state(self):
    extra = {}
    if self.critic is not None:
      extra["critic"] = self.critic.state
    if self.kl_ctl is not None:
      extra["kl_coef"] = jax.device_put(jnp.asarray(self.kl_ctl.value, jnp.float32), self.rep)
    if self.cfg.grpo.max_kl_action == "lower_lr":
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

  def _generate(self, params, step: int, version: int) -> Rollout:
    """Step `step`'s groups, sampled by the policy `params` (after `version` updates)."""
    g = self.cfg.grpo
    t0 = time.perf_counter()
    step_key = jax.random.fold_in(self.key, step - 1)
    lm = self._policy(params)
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

  def _rollout(self, state, step: int) -> tuple[Rollout, float]:
    """This step's rollout and the seconds spent waiting for it. Synchronous: sampled now by the current policy.
    With async_staleness k: first the rollouts up to step + k are submitted to the generation thread (each by the
    policy as it is now, version step - 1), then this step's, submitted k steps ago, is awaited."""
    k, full = self.cfg.grpo.async_staleness, self.setup.full
    if not k:
      return self._generate(self._for_sampling(full(state.params)), step, step - 1), 0.0
    snapshot = None
    for later in range(step, min(step + k, self.cfg.train.steps) + 1):
      if later not in self.in_flight:
        if snapshot is None:
          snapshot = self._for_sampling(full(state.params))
        self.in_flight[later] = self.generator.submit(self._generate, snapshot, later, step - 1)
    t0 = time.perf_counter()
    rollout = self.in_flight.pop(step)
    return (rollout.result() if isinstance(rollout, Future) else rollout), time.perf_counter() - t0

  def _for_sampling(self, params):
    """The policy as sampling reads it: copied to the rollout mesh in sampling's layout where there is one (the
    sampler's own re-layout then finds it in place); else on the training devices, copied when the generation
    thread reads it (the update donates the state's buffers)."""
    if self.setup.rollout_mesh is None:
      return jax.tree.map(jnp.copy, params) if self.cfg.grpo.async_staleness else params
    if self.sample_shardings is None:
      self.sample_shardings = nnx.to_pure_dict(state_shardings(self._policy(params), self.sample_mesh,
                                                               self.stage.rules or self.cfg.mesh.rules))
    if jax.process_count() > 1:  # across processes, disjoint device sets are bridged through each host's memory
      params = to_host(params)
    return jax.device_put(params, self.sample_shardings)

  def host_state(self):
    """The rollouts sampled for the next steps (async): checkpointed, so a resumed run trains on the same ones."""
    if not self.cfg.grpo.async_staleness:
      return None
    done = {s: r.result() if isinstance(r, Future) else r for s, r in self.in_flight.items()}
    self.in_flight = dict(done)
    return {str(s): {"groups": r.sampled.to_json(), "batches": r.batches, "version": r.version,
                     "seconds": r.seconds} for s, r in sorted(done.items())}

  def load_host_state(self, obj) -> None:
    self.in_flight = {int(s): Rollout(Groups.from_json(r["groups"]), r["batches"], r["version"], r["seconds"])
                      for s, r in obj.items()}

  def _shown(self, groups: Groups) -> list[dict]:
    """The first completion of each of the first log.samples groups, decoded, with its reward."""
    tok, rows = self.setup.tok, []
    for i, prompt in enumerate(groups.prompts[:self.cfg.log.samples]):
      j = i * groups.size
      completion = tok.decode(groups.response[j, :int(groups.lengths[j])].tolist(), skip_special_tokens=False)
      rows.append({"prompt": prompt.text, "completion": completion, "reward": float(groups.scores[j]),
                   "ground_truth": prompt.ground_truth, "where": prompt.where})
    return rows

  def train_step(self, state, step: int):
    cfg, g, n = self.cfg, self.cfg.grpo, self.spec.num_samples
    full, tok = self.setup.full, self.setup.tok
    self.step = step
    t0 = time.perf_counter()
    rollout, waited = self._rollout(state, step)
    sampled = rollout.sampled
    if self.log is not None and self.log.wants_samples(step):
      self.log.samples(step, self._shown(sampled))
    signal = sampled.informative()
    trained = sampled
    if self.compact_unit:  # leave out the groups the loss would mask: the same loss for less work
      kept = -(-int(signal.sum()) // self.compact_unit) * self.compact_unit
      trained = Groups.select([sampled], max(kept, self.compact_unit))

    batch = update_rows(trained, tok.pad_id)
    response_mask = batch["response_mask"]
    # Offline or asynchronous, the clipped ratio is taken against the stored behaviour log-probs, or (a rollout
    # correction) against the policy before this step's update, the behaviour log-probs then weighting or masking.
    old_is_current = trained.behaviour is None or self.loss_cfg.corrects
    if trained.behaviour is not None:
      batch["behaviour_logp" if self.loss_cfg.corrects else "old_logp"] = trained.behaviour
    device_batch = loop.global_from_full(batch, self.batch_sharding)
    if old_is_current and (g.ppo_epochs > 1 or g.mini_batches > 1 or g.kl_in_reward):
      device_batch["old_logp"] = self.logprobs(full(state.params), device_batch)  # else on-policy: objectives.grpo
    logs = step % cfg.train.log_every == 0 or step == cfg.train.steps
    evals = bool(cfg.train.eval_every and step % cfg.train.eval_every == 0 and self.eval_prompts)
    kl_to_ref = None
    if self.ref_every_step and g.kl_in_reward:  # the rewards subtract the KL: the advantages need it
      device_batch["ref_logp"] = self.ref_logprobs(self.reference, device_batch)
    elif not self.ref_every_step and (logs or evals):  # the policy's log-probs before this step's update, as the loss would see them on-policy
      current = device_batch["old_logp"] if old_is_current and "old_logp" in device_batch else \
          self.logprobs(full(state.params), device_batch)
      kl_to_ref = (current, self.ref_logprobs(self.reference, device_batch))
    agreement = {}
    rollout_logp = trained.behaviour if trained.behaviour is not None else trained.sampler_logp
    kept_logp = None
    if self.filtered and rollout_logp is not None and (self.loss_cfg.corrects or logs):
      kept_logp = self.kept_logprobs(full(state.params), device_batch)
      if self.loss_cfg.corrects:
        device_batch["kept_logp"] = kept_logp
    if logs and rollout_logp is not None:  # the sampler's log-probs against the trainer's, same tokens and weights
      current = kept_logp if kept_logp is not None else device_batch["old_logp"] if old_is_current and "old_logp" in \
          device_batch else kl_to_ref[0] if kl_to_ref is not None else self.logprobs(full(state.params), device_batch)
      agreement = logprob_agreement(rollout_logp, to_host(current), response_mask)
    kl_coef = self.kl_ctl.value if self.kl_ctl is not None else g.kl_coef
    groups = np.repeat(np.arange(len(trained.prompts)), n)
    adv, extra_cols, adv_metrics = advantages(g, device_batch, trained.scores, groups, self.critic, kl_coef,
                                              trained.baselines, trained.token_rewards)
    if g.dynamic_sampling:  # DAPO: groups with identical rewards carry no signal; keep them out of the loss
      extra_cols["response_mask"] = response_mask * np.repeat(trained.informative(), n)[:, None]
    no_signal = not np.any((adv != 0) & (extra_cols.get("response_mask", response_mask) > 0))
    skip_update = no_signal and g.no_signal == "skip" and self.critic is None  # a critic still learns the returns
    device_batch.update(loop.global_from_full({"advantages": adv, **extra_cols}, self.batch_sharding))
    if self.ref_every_step and not g.kl_in_reward and not skip_update:  # only the loss's KL term reads it
      device_batch["ref_logp"] = self.ref_logprobs(self.reference, device_batch)
    if kl_to_ref is not None:
      kl_to_ref = float(self.report_kl(*kl_to_ref, device_batch["response_mask"]))
    if self.kl_ctl is not None:  # kept in float32, as checkpointed, so a resumed run continues bitwise
      self.kl_ctl.value = float(np.float32(self.kl_ctl.update(adv_metrics["actor/reward_kl"], self.rows)))

    t1 = time.perf_counter()
    state, metrics = self._update(state, device_batch, step, epochs=0 if skip_update else g.ppo_epochs)
    metrics.update(adv_metrics)
    metrics["actor/no_signal"] = float(no_signal)
    if no_signal and logs:
      self.say(f"step {step}: no signal this step ({int(signal.sum())} of {len(signal)} groups have rewards that "
               "differ; every advantage is 0)" + ("; update skipped" if skip_update else ""))
    if kl_to_ref is not None:
      metrics["actor/kl_loss"] = kl_to_ref
    metrics.update(agreement)
    if self.kl_ctl is not None or g.kl_in_reward:
      metrics["actor/kl_coef"] = kl_coef
    if sampled.rm_scores is not None:
      metrics["critic/rm_score/mean"] = float(np.mean(sampled.rm_scores))
    if sampled.counts is not None:
      metrics.update(agent_summary(sampled.counts, sampled.lengths))
    metrics.update({"critic/score/mean": float(np.mean(sampled.scores)),
                    "response_length/mean": float(np.mean(sampled.lengths)),
                    "actor/informative_groups": float(np.mean(signal)),
                    "timing_s/gen": rollout.seconds, "timing_s/update": time.perf_counter() - t1,
                    "timing_s/step": time.perf_counter() - t0, "actor/gen_batches": rollout.batches,
                    "actor/update_groups": len(trained.prompts)})
    if g.async_staleness:
      metrics.update({"rollout/policy_lag": float(step - 1 - rollout.version), "timing_s/gen_wait": waited})
    signals, warnings = self.monitors.after_step(step, metrics, _example(trained, tok, self.rewards)
                                                 if no_signal else "")
    metrics.update(signals)
    for line in warnings:
      self.say(f"warning: {line}")
    self._kl_bound(step, metrics.get("actor/kl_loss", 0.0))
    self.last = metrics
    return state, loop.StepOut(metrics, records=[p.where for p in trained.prompts])

  def _update(self, state, device_batch: dict, step: int, epochs: int):
    """`epochs` passes of shuffled mini-batches through the policy update (and the critic's); the metrics averaged
    over the updates (the skip counts as they stand)."""
    g = self.cfg.grpo
    sums: dict[str, float] = {}
    order_key = jax.random.fold_in(jax.random.fold_in(self.key, step - 1), 1)
    for epoch in range(epochs):
      for chunk in minibatches(jax.random.fold_in(order_key, epoch), len(device_batch["response"]), g.mini_batches,
                               self.group_size):
        mb = device_batch if g.mini_batches == 1 else self.take_rows(
            device_batch, jax.device_put(np.asarray(chunk, np.int32), self.rep))
        m = {}
        if self.critic is None or step - 1 >= g.critic_warmup:
          state, m = self._update_fn(mb["response"].shape[0])(state, mb)
        if self.critic is not None:
          m = {**m, **self.critic.update(mb)}
        for k, v in jax.device_get(m).items():
          sums[k] = float(v) if k.endswith("skipped_nonfinite") else sums.get(k, 0.0) + float(v)  # counts
    metrics = {k.replace("train/loss", "actor/loss"): v if k.endswith("skipped_nonfinite") else v / g.updates_per_step
               for k, v in sums.items()}
    return state, metrics

  def _kl_bound(self, step: int, kl: float) -> None:
    """grpo.max_kl: past it, lower the learning rate for the next steps or end the run here."""
    g = self.cfg.grpo
    if not g.max_kl or kl <= g.max_kl:
      return
    if g.max_kl_action == "lower_lr":
      self.lr_scale = float(np.float32(self.lr_scale * g.kl_lr_factor))
      self.updates.clear()
      self.say(f"step {step}: KL to the reference {kl:.4f} exceeds grpo.max_kl={g.max_kl}; learning rate lowered "
               f"to {self.lr_scale:g} x optim.lr")
      self.log.write(step, {"monitor/lr_scale": self.lr_scale})
    else:
      self.stop_reason = f"KL to the reference {kl:.4f} exceeds grpo.max_kl={g.max_kl}"


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, GrpoTask(cfg))


def _example(groups: Groups, tok, rewards: RewardSpec) -> str:
  """The rewards and the first scored completion of `groups`, for messages about the reward."""
  p = groups.prompts[0]
  text = tok.decode(groups.response[0, :groups.lengths[0]])
  names = ", ".join(f"{name} x {w:g}" for name, w in rewards.weights)
  return (f"Rewards: {names}. For example {p.where} (ground truth {p.ground_truth!r}) scored "
          f"{float(groups.scores[0]):g} for the completion {text[:160]!r}.")
