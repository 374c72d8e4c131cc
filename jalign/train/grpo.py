"""GRPO and PPO: prompts -> `sampling.generate` (n per prompt) -> rewards -> advantages -> ppo_epochs x
mini-batches of clipped-surrogate updates with a KL penalty to the frozen reference policy (in the loss, or
subtracted from the reward with a fixed or adaptive coefficient). Advantages come from group baselines (GRPO,
Dr.GRPO, RLOO, REINFORCE++-baseline), discounted returns (REINFORCE++) or GAE over a learned critic (PPO; the critic
has its own optimizer and is updated on the same mini-batches). Online, or offline from a replay buffer.

Checkpoints hold the train state, the prompt iterator, the critic and the KL coefficient; a rerun resumes where the
last checkpoint left off.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models, parallel, sampling
from jalign.models.sharding import to_host
from jalign.config import RunConfig, as_dict, reward_spec, sampling_rules
from jalign.data.sources import open_source
from jalign.eval.policy import accuracy
from jalign.losses import advantages as adv_lib, policy as policy_lib
from jalign.objectives import grpo as objective
from jalign.rl.rewards import NEEDS_GROUND_TRUTH, Batch, RewardSpec
from jalign.rl.groups import Groups, OfflineBuffer, minibatches
from jalign.rl.monitors import Monitors
from jalign.data.prompts import encode_prompt, left_pad
from jalign.train import loop, optimizer as optim_lib
from jalign.train.checkpoint import Checkpointer, abstract_like
from jalign.train.critic import Critic
from jalign.train.metrics import MetricsWriter
from jalign.train.preemption import Preemption


def _prompt_iterator(cfg: RunConfig, n: int):
  ds = grain.MapDataset.range(n).seed(cfg.seed).shuffle().repeat(None)
  return iter(ds.batch(cfg.grpo.prompts_per_step).to_iter_dataset())


def run(cfg: RunConfig) -> dict:
  g, s = cfg.grpo, cfg.sampling
  optimizer, _ = optim_lib.make(cfg.optim, cfg.train.steps)
  setup = loop.setup(cfg, optimizer)
  mesh, tok, graphdef = setup.mesh, setup.tok, setup.graphdef
  rewards = reward_spec(cfg)
  model_reward = None
  if cfg.reward.model:
    from jalign.rl.model_reward import ModelReward
    model_reward = ModelReward(cfg.reward.model, cfg.reward.model_weight, mesh, cfg.mesh.rules)
  gen_rules = sampling_rules(cfg)
  metric = next((n for n, _ in rewards.weights if n in NEEDS_GROUND_TRUTH), None)
  max_prompt = min(s.max_prompt_length, setup.model_cfg.max_position_embeddings - s.max_new_tokens)
  encode = functools.partial(encode_prompt, tok=tok, max_length=max_prompt)
  offline = OfflineBuffer(g.buffer, s.num_samples, s.max_new_tokens) if g.buffer else None
  source = open_source(g.prompts, cfg.data.fields()) if offline is None else offline
  eval_prompts = []
  if g.eval_prompts and metric:
    eval_source = open_source(g.eval_prompts, cfg.data.fields())
    eval_prompts = [encode(eval_source[i], index=i, where=eval_source.where(i))
                    for i in range(min(len(eval_source), g.eval_examples))]

  rows = g.prompts_per_step * s.num_samples
  # Mini-batches are drawn as whole groups (each prompt's samples together, in order, as verl splits its rollout), so
  # the update can run each prompt once per group.
  group_size = s.num_samples if g.share_prompts and g.prompts_per_step % g.mini_batches == 0 else 0
  loss_cfg = objective.GrpoLossConfig(clip_low=g.clip_low, clip_high=g.clip_high, clip_c=g.clip_c, mode=g.loss_mode,
                                      agg=g.agg, kl_coef=0.0 if g.kl_in_reward else g.kl_coef, kl_kind=g.kl_kind,
                                      entropy_coef=g.entropy_coef, temperature=s.temperature, group_size=group_size,
                                      tis_cap=g.tis_imp_ratio_cap, norm_rows=rows // g.mini_batches,
                                      tau_pos=g.tau_pos, tau_neg=g.tau_neg,
                                      horizon=g.loss_scale_factor)
  # grpo.compact_sizes: the update batch holds the informative groups only, padded to a multiple of `compact_unit`.
  compact_unit = g.prompts_per_step // g.compact_sizes if g.compact_sizes else 0
  batch_sharding = parallel.batch_sharding(mesh)
  rep = parallel.replicated(mesh)
  # A mini-batch's rows, taken in one compiled program: eager indexing of a global array runs several small
  # programs per column, and two processes could enter them in different orders and wait on each other.
  take_rows = jax.jit(lambda batch, rows_R: jax.tree.map(lambda v: v[rows_R], batch), out_shardings=batch_sharding)

  def build_update(lr_scale: float, mini_batch_rows: int):
    """The jitted policy update at `lr_scale` x the configured learning rate (the optimizer state's structure does
    not depend on it, so lowering it mid-run only recompiles), for mini-batches of `mini_batch_rows` rows."""
    loss_fn = objective.make_loss_fn(graphdef, dataclasses.replace(loss_cfg, global_rows=mini_batch_rows),
                                     cfg.logprobs.options())
    opt, schedule = optim_lib.make(dataclasses.replace(cfg.optim, lr=cfg.optim.lr * lr_scale), cfg.train.steps,
                                   g.updates_per_step)
    jitted = loop.jit_step(loss_fn, opt, schedule, 1, mesh, setup.trainable(), dropout_seed=loop.dropout_seed(cfg))
    return lambda state, batch: jitted(state, batch, setup.frozen)

  lr_scale = 1.0
  updates = {}  # mini-batch rows -> jitted update at the current lr_scale

  def update(state, batch):
    n = batch["response"].shape[0]
    if n not in updates:
      updates[n] = build_update(lr_scale, n)
    return updates[n](state, batch)
  logprobs_fn = lambda params, batch: objective.response_logprobs(graphdef, params, batch, s.temperature,  # noqa
                                                                   cfg.logprobs.options(), group_size)[0]
  logprobs = jax.jit(logprobs_fn)
  state = setup.state
  full = setup.full
  reference = setup.reference()
  ref_logprobs = jax.jit(parallel.fetching(logprobs_fn, reference)) if cfg.model.offload_reference else logprobs
  # The reference acts through the KL coefficient only: at 0 (DAPO's recipe, no KL term) its forward runs on the steps
  # that report the KL to it, not on every step.
  ref_every_step = bool(g.kl_coef) or g.kl_in_reward or g.kl_ctrl == "adaptive" or bool(g.max_kl)
  report_kl = jax.jit(lambda logp, ref_logp, mask: adv_lib.masked_mean(
      policy_lib.kl_penalty(logp, ref_logp, g.kl_kind), mask.astype(jnp.float32)), out_shardings=rep)
  critic = Critic(cfg, nnx.merge(graphdef, full(state.params)), mesh, rows // g.mini_batches) \
      if g.adv_estimator == "gae" else None
  kl_ctl = policy_lib.AdaptiveKL(g.kl_coef, g.kl_target, g.kl_horizon) if g.kl_ctrl == "adaptive" else None

  def extra_state():
    extra = {}
    if critic is not None:
      extra["critic"] = critic.state
    if kl_ctl is not None:
      extra["kl_coef"] = jax.device_put(jnp.asarray(kl_ctl.value, jnp.float32), rep)
    if g.max_kl_action == "lower_lr":
      extra["lr_scale"] = jax.device_put(jnp.asarray(lr_scale, jnp.float32), rep)
    return extra or None

  prompts_it = _prompt_iterator(cfg, len(source))
  ckpt = Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                      async_save=cfg.checkpoint.async_save)
  start = 0
  latest = ckpt.latest_intact_step() if cfg.checkpoint.resume else None
  if latest is not None:
    extra = extra_state()
    if extra is None:
      state = ckpt.restore(latest, abstract_like(state), prompts_it)
    else:
      state, extra = ckpt.restore(latest, abstract_like(state), prompts_it, abstract_extra=abstract_like(extra))
      if critic is not None:
        critic.state = extra["critic"]
      if kl_ctl is not None:
        kl_ctl.value = float(extra["kl_coef"])
      if g.max_kl_action == "lower_lr" and float(extra["lr_scale"]) != lr_scale:
        lr_scale = float(extra["lr_scale"])
    start = latest
  writer = MetricsWriter(cfg.log, cfg.run_dir, cfg.train.steps, start, as_dict(cfg))
  if latest is not None:
    writer.print(f"resumed from {ckpt.directory}/{latest}")
  key = jax.random.key(cfg.seed)
  policy = lambda st: nnx.merge(graphdef, full(st.params))
  monitors = Monitors(entropy_floor=g.entropy_floor, no_signal_warn_steps=g.no_signal_warn_steps)

  def collect(indices, gen_key) -> Groups:
    """One prompt batch's groups: sampled and scored online, or read from the replay buffer offline."""
    indices = [int(i) for i in indices]
    if offline is not None:
      prompts, response, lengths, scores, behaviour = offline.batch(indices, tok.pad_id)
      return Groups(prompts, s.num_samples, response, lengths, scores, behaviour)
    prompts = [encode(source[i], index=i, where=source.where(i)) for i in indices]
    ids, mask = left_pad(prompts, tok.pad_id)
    out = sampling.generate(policy(state), ids, mask, gen_key, max_new_tokens=s.max_new_tokens,
                            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                            stop_token_ids=(tok.eos_id,), num_samples=s.num_samples, pad_id=tok.pad_id, mesh=mesh,
                            rules=gen_rules)
    response, lengths = to_host((out.tokens, out.lengths))
    scores, rm_scores = score(prompts, ids, mask, response, lengths, s.num_samples)
    baselines = None
    if g.adv_estimator == "remax":  # verl: the greedy response's reward, generated for the same prompts
      greedy = sampling.generate(policy(state), ids, mask, gen_key, max_new_tokens=s.max_new_tokens,
                                 temperature=0.0, stop_token_ids=(tok.eos_id,), pad_id=tok.pad_id, mesh=mesh,
                                 rules=gen_rules)
      baselines = np.repeat(score(prompts, ids, mask, *to_host((greedy.tokens, greedy.lengths)), 1)[0],
                            s.num_samples)
    return Groups(prompts, s.num_samples, response, lengths, scores, None, rm_scores, baselines)

  def score(prompts, ids, mask, response, lengths, n):
    """Rewards [B * n] of the responses (n per prompt) and the reward model's share of them (or None)."""
    owners = [prompts[i // n] for i in range(len(response))]
    texts = [tok.decode(response[i, :lengths[i]]) for i in range(len(response))]
    scores, _ = rewards(Batch(texts, [p.ground_truth for p in owners], lengths, [p.where for p in owners]))
    rm_scores = None
    if model_reward is not None:
      rm_scores = model_reward(np.repeat(ids, n, 0), np.repeat(mask, n, 0), response, lengths)
      scores = scores + model_reward.weight * rm_scores
    return scores, rm_scores

  with Preemption(cfg.checkpoint.preempt_grace_s, ckpt.newest_complete) as preempt, jax.set_mesh(mesh):
    initial_acc = None
    if eval_prompts:
      on_device = parallel.in_memory(reference, "device") if cfg.model.offload_reference else reference
      initial_acc = accuracy(nnx.merge(graphdef, on_device), tok, eval_prompts, metric, s.max_new_tokens)
      del on_device
      writer.print(f"held-out {metric} accuracy of the initial policy: {initial_acc:.4f}")
      writer.write(start, {"eval/accuracy": initial_acc})
      monitors.after_eval(start, initial_acc, len(eval_prompts))
    final: dict[str, float] = {}
    for step in range(start, cfg.train.steps):
      t0 = time.perf_counter()
      step_key = jax.random.fold_in(key, step)
      batches = [collect(next(prompts_it), step_key)]
      if g.dynamic_sampling:  # DAPO: refill until prompts_per_step groups carry signal (verl filter_groups)
        while sum(int(b.informative().sum()) for b in batches) < g.prompts_per_step \
            and len(batches) < g.max_gen_batches:
          batches.append(collect(next(prompts_it), jax.random.fold_in(step_key, len(batches) + 1)))
      sampled = Groups.select(batches, g.prompts_per_step) if len(batches) > 1 else batches[0]
      signal = sampled.informative()
      sampled_metrics = {"critic/score/mean": float(np.mean(sampled.scores)),
                         "response_length/mean": float(np.mean(sampled.lengths)),
                         "actor/informative_groups": float(np.mean(signal))}
      trained = sampled
      if compact_unit:  # leave out the groups the loss would mask: the same loss for less work
        kept = -(-int(signal.sum()) // compact_unit) * compact_unit
        trained = Groups.select([sampled], max(kept, compact_unit))
      prompts, response, lengths, scores, behaviour = (trained.prompts, trained.response, trained.lengths,
                                                       trained.scores, trained.behaviour)
      ids, mask = left_pad(prompts, tok.pad_id)
      t_gen = time.perf_counter() - t0

      groups = np.repeat(np.arange(len(prompts)), s.num_samples)
      response_mask = (np.arange(s.max_new_tokens)[None] < lengths[:, None]).astype(np.int32)
      informative = np.repeat(trained.informative(), s.num_samples)
      prompt_ids, prompt_mask = np.repeat(ids, s.num_samples, 0), np.repeat(mask, s.num_samples, 0)
      segment = np.concatenate([prompt_mask, response_mask], 1)
      batch = {"tokens": np.concatenate([prompt_ids, response], 1).astype(np.int32),
               "segment_ids": segment.astype(np.int32),
               "positions": np.maximum(np.cumsum(segment, 1) - 1, 0).astype(np.int32),
               "response": response.astype(np.int32), "response_mask": response_mask}
      # Offline, the clipped ratio is taken against the stored behaviour log-probs, or (TIS) against the policy
      # before this step's update, the behaviour log-probs then giving each token's truncated importance weight.
      old_is_current = behaviour is None or bool(g.tis_imp_ratio_cap)
      if behaviour is not None:
        batch["behaviour_logp" if g.tis_imp_ratio_cap else "old_logp"] = behaviour
      device_batch = loop.global_from_full(batch, batch_sharding)
      if old_is_current and (g.ppo_epochs > 1 or g.mini_batches > 1 or g.kl_in_reward):
        device_batch["old_logp"] = logprobs(full(state.params), device_batch)  # else on-policy: see objectives.grpo
      logs = (step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps
      evals = bool(cfg.train.eval_every and (step + 1) % cfg.train.eval_every == 0 and eval_prompts)
      kl_to_ref = None
      if ref_every_step:
        device_batch["ref_logp"] = ref_logprobs(reference, device_batch)
      elif logs or evals:  # the policy's log-probs before this step's update, as the loss would see them on-policy
        current = device_batch["old_logp"] if old_is_current and "old_logp" in device_batch else \
            logprobs(full(state.params), device_batch)
        kl_to_ref = (current, ref_logprobs(reference, device_batch))
      kl_coef = kl_ctl.value if kl_ctl is not None else g.kl_coef
      adv, extra_cols, adv_metrics = _advantages(g, device_batch, scores, groups, critic, kl_coef, trained.baselines)
      if g.dynamic_sampling:  # DAPO: groups with identical rewards carry no signal; keep them out of the loss
        extra_cols["response_mask"] = response_mask * informative[:, None]
      no_signal = not np.any((adv != 0) & (extra_cols.get("response_mask", response_mask) > 0))
      skip_update = no_signal and g.no_signal == "skip" and critic is None  # a critic still learns the returns
      device_batch.update(loop.global_from_full({"advantages": adv, **extra_cols}, batch_sharding))
      if kl_to_ref is not None:
        kl_to_ref = float(report_kl(*kl_to_ref, device_batch["response_mask"]))
      if kl_ctl is not None:  # kept in float32, as checkpointed, so a resumed run continues bitwise
        kl_ctl.value = float(np.float32(kl_ctl.update(adv_metrics["actor/reward_kl"], rows)))

      t1 = time.perf_counter()
      sums: dict[str, float] = {}
      order_key = jax.random.fold_in(jax.random.fold_in(key, step), 1)
      for epoch in range(0 if skip_update else g.ppo_epochs):
        for chunk in minibatches(jax.random.fold_in(order_key, epoch), len(response), g.mini_batches, group_size):
          mb = device_batch if g.mini_batches == 1 else take_rows(device_batch,
                                                                   jax.device_put(np.asarray(chunk, np.int32), rep))
          m = {}
          if critic is None or step >= g.critic_warmup:
            state, m = update(state, mb)
          if critic is not None:
            m = {**m, **critic.update(mb)}
          for k, v in jax.device_get(m).items():
            sums[k] = float(v) if k.endswith("skipped_nonfinite") else sums.get(k, 0.0) + float(v)  # counts
      n_updates = g.updates_per_step
      metrics = {k.replace("train/loss", "actor/loss"): v if k.endswith("skipped_nonfinite") else v / n_updates
                 for k, v in sums.items()}
      metrics.update(adv_metrics)
      metrics["actor/no_signal"] = float(no_signal)
      if no_signal and logs:
        writer.print(f"step {step + 1}: no signal this step ({int(signal.sum())} of {len(signal)} groups have "
                     "rewards that differ; every advantage is 0)" + ("; update skipped" if skip_update else ""))
      if kl_to_ref is not None:
        metrics["actor/kl_loss"] = kl_to_ref
      if metrics.get("train/nonfinite", 0.0) > 0 or metrics.get("critic/nonfinite", 0.0) > 0:
        if cfg.train.nonfinite == "stop":
          ckpt.wait()
          raise loop.NonFiniteError(loop.nonfinite_message(step + 1, metrics, [p.where for p in prompts],
                                                           ckpt.directory, ckpt.latest_step()))
        skipped = metrics.get("train/skipped_nonfinite", 0) + metrics.get("critic/skipped_nonfinite", 0)
        writer.print(f"step {step + 1}: non-finite loss or gradient; update(s) skipped ({int(skipped)} so far)")
      if kl_ctl is not None or g.kl_in_reward:
        metrics["actor/kl_coef"] = kl_coef
      if sampled.rm_scores is not None:
        metrics["critic/rm_score/mean"] = float(np.mean(sampled.rm_scores))
      metrics.update({**sampled_metrics, "timing_s/gen": t_gen, "timing_s/update": time.perf_counter() - t1,
                      "timing_s/step": time.perf_counter() - t0, "actor/gen_batches": len(batches),
                      "actor/update_groups": len(prompts)})
      signals, warnings = monitors.after_step(step + 1, metrics, _example(trained, tok, rewards) if no_signal else "")
      metrics.update(signals)
      for line in warnings:
        writer.print(f"warning: {line}")
      final = metrics
      if logs:
        writer.write(step + 1, metrics)
      writer.advance()
      if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0 and step + 1 < cfg.train.steps:
        ckpt.save(step + 1, state, prompts_it, as_dict(cfg), extra=extra_state())
      if evals:
        acc = accuracy(policy(state), tok, eval_prompts, metric, s.max_new_tokens)
        signals, warnings = monitors.after_eval(step + 1, acc, len(eval_prompts))
        writer.write(step + 1, {"eval/accuracy": acc, **signals})
        for line in warnings:
          writer.print(f"warning: {line}")
        writer.print(f"step {step + 1}: held-out {metric} accuracy {acc:.4f}  KL to reference "
                     f"{metrics.get('actor/kl_loss', 0.0):.4f}")
      if g.max_kl and metrics.get("actor/kl_loss", 0.0) > g.max_kl and g.max_kl_action == "lower_lr":
        lr_scale = float(np.float32(lr_scale * g.kl_lr_factor))
        updates.clear()
        writer.print(f"step {step + 1}: KL to the reference {metrics['actor/kl_loss']:.4f} exceeds grpo.max_kl="
                     f"{g.max_kl}; learning rate lowered to {lr_scale:g} x optim.lr")
        writer.write(step + 1, {"monitor/lr_scale": lr_scale})
      elif g.max_kl and metrics.get("actor/kl_loss", 0.0) > g.max_kl:
        ckpt.save(step + 1, state, prompts_it, as_dict(cfg), extra=extra_state())
        writer.print(f"stopping at step {step + 1}: KL to the reference {metrics['actor/kl_loss']:.4f} exceeds "
                     f"grpo.max_kl={g.max_kl}; checkpoint saved")
        break
      if preempt.should_stop(step + 1) and step + 1 < cfg.train.steps:
        preempt.stop(step + 1, lambda: ckpt.save(step + 1, state, prompts_it, as_dict(cfg), extra=extra_state()),
                     ckpt, writer, saved_already=bool(cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0))
    else:
      if latest is None or latest < cfg.train.steps:
        ckpt.save(cfg.train.steps, state, prompts_it, as_dict(cfg), extra=extra_state())
    ckpt.close()
    if eval_prompts:
      acc = accuracy(policy(state), tok, eval_prompts, metric, s.max_new_tokens)
      final["eval/accuracy"] = acc
      final["eval/accuracy_initial"] = initial_acc
      writer.write(cfg.train.steps, {"eval/accuracy": acc})
      writer.print(f"held-out {metric} accuracy: {initial_acc:.4f} -> {acc:.4f} ({(acc - initial_acc) * 100:+.1f} "
                   f"points); KL to reference {final.get('actor/kl_loss', 0.0):.4f}")
    if cfg.checkpoint.export_hf:  # every process gathers the weights; process 0 writes
      models.save_pretrained(policy(state), os.path.join(cfg.run_dir, "hf"), tokenizer=tok)
  writer.close()
  return final


def _example(groups: Groups, tok, rewards: RewardSpec) -> str:
  """The rewards and the first scored completion of `groups`, for messages about the reward."""
  p = groups.prompts[0]
  text = tok.decode(groups.response[0, :groups.lengths[0]])
  names = ", ".join(f"{name} x {w:g}" for name, w in rewards.weights)
  return (f"Rewards: {names}. For example {p.where} (ground truth {p.ground_truth!r}) scored "
          f"{float(groups.scores[0]):g} for the completion {text[:160]!r}.")


def _advantages(g, device_batch: dict, scores: np.ndarray, groups: np.ndarray, critic: Critic | None,
                kl_coef: float, baselines: np.ndarray | None = None):
  """Host arrays: advantages [N, R], the extra batch columns (`returns`, `old_values` for the critic) and metrics.
  Token rewards are the outcome on each response's last token, minus kl_coef x KL(old || ref) per token when the KL
  goes in the reward (verl `apply_kl_penalty`). `baselines` [N]: remax's greedy-response rewards."""
  mask = device_batch["response_mask"].astype(jnp.float32)
  token_rewards = adv_lib.outcome_to_tokens(jnp.asarray(scores), mask)
  metrics = {}
  if g.kl_in_reward:
    kl = policy_lib.kl_penalty(device_batch["old_logp"], device_batch["ref_logp"], g.kl_kind) * mask
    token_rewards = token_rewards - kl_coef * kl
    metrics["actor/reward_kl"] = float(adv_lib.masked_mean(kl, mask))
  values = critic.values(device_batch) if critic is not None else None
  adv, returns = adv_lib.estimate(g.adv_estimator, token_rewards, mask, jnp.asarray(groups), values_BxT=values,
                                  baselines_B=None if baselines is None else jnp.asarray(baselines, jnp.float32),
                                  gamma=g.gamma, lam=g.lam)
  if baselines is not None:
    metrics["critic/remax_baseline/mean"] = float(np.mean(baselines))
  extra = {}
  if critic is not None:
    returns, values, m = to_host((returns, values, mask))
    extra = {"returns": returns.astype(np.float32), "old_values": values.astype(np.float32)}
    r, residual = returns[m > 0], (returns - values)[m > 0]
    metrics.update({"critic/vf_explained_var": float(1.0 - residual.var() / max(r.var(), 1e-8)),
                    "critic/values/mean": float(values[m > 0].mean()), "critic/returns/mean": float(r.mean())})
  metrics["critic/advantages/mean"] = float(adv_lib.masked_mean(adv, mask))
  return to_host(adv).astype(np.float32), extra, metrics
