"""GRPO / PPO's own settings (the run config's `grpo` section): the prompts or replay buffer, the step's batch and
updates, DAPO's dynamic sampling, held-out prompts, the run's monitors and asynchronous rollouts; and the checks
across it and the sections the clipped update shares with other tasks (`advantage`, `kl`, `policy_loss`, `critic`,
`env`), each declared beside the code that reads it."""
from __future__ import annotations

import dataclasses
from typing import Literal

from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.losses.advantages import GROUP_LOCAL_ESTIMATORS

# The keys that left the grpo section for the section of their owner: old key -> its place now.
MOVED = {
    **{k: f"policy_loss.{k}" for k in ("clip_low", "clip_high", "clip_c", "tau_pos", "tau_neg", "agg",
                                        "loss_scale_factor", "entropy_coef", "rollout_is", "rollout_is_threshold",
                                        "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower")},
    "loss_mode": "policy_loss.mode", "adv_estimator": "advantage.estimator", "gamma": "advantage.gamma",
    "lam": "advantage.lam", "kl_coef": "kl.coef", "kl_kind": "kl.kind", "kl_in_reward": "kl.in_reward",
    "kl_ctrl": "kl.ctrl", "kl_target": "kl.target", "kl_horizon": "kl.horizon", "max_kl": "kl.max",
    "max_kl_action": "kl.max_action", "kl_lr_factor": "kl.lr_factor", "critic_lr": "critic.lr",
    "value_clip": "critic.value_clip", "critic_warmup": "critic.warmup", "env": "env.name",
    "env_max_turns": "env.max_turns", "env_tool_format": "env.tool_format", "env_max_tokens": "env.max_tokens",
    "env_error_reward": "env.error_reward"}


@dataclasses.dataclass(frozen=True)
class GrpoSection:
  prompts: str = ""                       # training prompts (same specs as data.train)
  buffer: str = ""                        # offline mode: a replay buffer directory from the rollout task
  prompts_per_step: int = bounded(16, gt=0)  # x sampling.num_samples completions per step
  mini_batches: int = bounded(1, gt=0)    # optimizer updates per epoch over the step's completions
  ppo_epochs: int = bounded(1, gt=0)      # passes over the step's completions
  dynamic_sampling: bool = False          # DAPO: drop groups whose rewards are all equal (out of the loss) ...
  max_gen_batches: int = bounded(1, ge=1)  # ... and sample up to this many prompt batches per step to refill
                                          # prompts_per_step informative groups (verl filter_groups.max_num_gen_batches)
  compact_sizes: int = bounded(0, ge=0)   # > 0: the update leaves the dropped groups out of its batch instead of
                                          # masking them (less work, same loss), padded to a multiple of
                                          # prompts_per_step / compact_sizes groups: at most this many batch shapes,
                                          # each compiled once
  share_prompts: bool = True              # each prompt runs through the model once per group in the update (its
                                          # keys/values shared by the group's samples; mini-batches then hold whole
                                          # groups, which needs mini_batches to divide prompts_per_step); not with remat
  eval_prompts: str = ""                  # held-out prompts for greedy accuracy; "" = none
  eval_examples: int = bounded(500, ge=0)  # held-out prompts evaluated (the first N of eval_prompts)
  entropy_floor: float = 0.01             # warn (monitor/entropy_collapse) below this mean token entropy; 0 = off
  # a step whose advantages are all 0 (every group's rewards equal) carries no signal: "skip" leaves its update out
  # (the KL / entropy terms alone would only pull the policy toward the reference), "update" runs it as peers do
  no_signal: Literal["skip", "update"] = "skip"
  no_signal_warn_steps: int = bounded(5, ge=0)  # warn once when the run's first N steps all carried no signal; 0 = off
  # Asynchronous GRPO/PPO: step t trains on rollouts sampled by the policy of k updates before (version t-1-k), so
  # the rollouts of steps t+1..t+k are generated while step t updates. Exactly k (not "up to k"), so a run is the
  # same however the threads interleave and resumes bitwise (the in-flight rollouts are checkpointed). The stored
  # sampler log-probs are the behaviour policy's: the clipped ratio is taken against them, or with a rollout
  # correction (rollout_is / rollout_rs) against the policy before the update. 0 = synchronous.
  async_staleness: int = bounded(0, ge=0)
  # Partial rollouts (with async_staleness k >= 2): a step's responses are sampled over the k updates before it, a
  # segment of ceil(max_new_tokens / k) tokens per update, the last one to the end, each by the policy of its time:
  # at a weight update the responses in flight continue under the new weights (re-prefilled by them) rather than
  # being finished by the old ones. Each token keeps its own behaviour log-prob and version; a token is at most k
  # updates old, as with whole rollouts, and the later segments' tokens are fresher (rollout/policy_lag: per token).
  partial_rollouts: bool = False
  # Sampling on devices of its own: a (data, fsdp, tensor[, expert]) mesh over each process's last devices (its product
  # a multiple of the process count), the training mesh (mesh.shape) over the rest; the policy's weights are copied
  # across when a rollout is submitted. With async_staleness the update and the generation then run side by side
  # rather than interleaved on shared devices. () = sampling on the training mesh.
  rollout_mesh: tuple[int, ...] = ()
  # MoE: the update routes each token to the experts the sampler used for it (R3, Ma et al. 2025), recorded per
  # layer as it sampled (a replay buffer's: as its rollout did), so the trainer's experts are the sampler's; the
  # router still trains through their gate values. rollout/routing_mismatch reports how often they differ, either way.
  routing_replay: bool = False

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per training step (policy and critic alike)."""
    return self.mini_batches * self.ppo_epochs


def check(cfg, dp: int) -> None:
  """The checks across the grpo section, the sections the update shares (advantage, kl, policy_loss, critic, env)
  and sampling, for the task of `cfg` (a `jalign.config.RunConfig`) on data-parallel size `dp`."""
  g, s, a, kl, loss, env = cfg.grpo, cfg.sampling, cfg.advantage, cfg.kl, cfg.policy_loss, cfg.env
  loss.check()
  env.check()
  if not g.prompts and not g.buffer:
    raise ConfigError("config.grpo.prompts: empty; give a prompt file/glob, tfds:... or synthetic:TASK:SPLIT "
                      "(or grpo.buffer for offline training)")
  if s.num_samples < 2 and a.estimator in ("grpo", "rloo"):
    raise ConfigError(f"config.sampling.num_samples={s.num_samples}: advantage.estimator={a.estimator!r} compares "
                      "completions of the same prompt and needs at least 2")
  rows = g.prompts_per_step * s.num_samples
  if rows % g.mini_batches:
    raise ConfigError(f"config.grpo.mini_batches={g.mini_batches} does not divide the {rows} completions per step "
                      f"(grpo.prompts_per_step x sampling.num_samples)")
  if s.temperature == 0:
    raise ConfigError("config.sampling.temperature=0: GRPO needs sampled (not greedy) completions")
  if cfg.task == "ppo" and a.estimator != "gae":
    raise ConfigError(f"config.advantage.estimator={a.estimator!r}: task 'ppo' trains a critic for GAE; set "
                      "'gae' (or use task 'grpo' for critic-free estimators)")
  if a.estimator != "gae" and cfg.critic != type(cfg.critic)():
    changed = next(f.name for f in dataclasses.fields(cfg.critic) if getattr(cfg.critic, f.name) != f.default)
    raise ConfigError(f"config.critic.{changed}={getattr(cfg.critic, changed)!r}: only advantage.estimator='gae' "
                      f"trains a critic (this run's is {a.estimator!r}); leave the critic section at its defaults")
  if kl.ctrl == "adaptive" and not kl.in_reward:
    raise ConfigError("config.kl.ctrl='adaptive' steers the KL subtracted from the reward; set kl.in_reward=True "
                      "(or kl.ctrl='fixed')")
  if g.dynamic_sampling and s.num_samples < 2:
    raise ConfigError(f"config.grpo.dynamic_sampling=True drops groups whose rewards are all equal: with "
                      f"sampling.num_samples={s.num_samples} every group would be dropped; set num_samples >= 2 or "
                      "dynamic_sampling=False")
  if loss.corrects and not (g.buffer or g.async_staleness):
    key = f"rollout_is={loss.rollout_is!r}" if loss.rollout_is else f"rollout_rs={loss.rollout_rs!r}"
    raise ConfigError(f"config.policy_loss.{key}: rollout corrections need behaviour log-probs of an older policy, "
                      "which a replay buffer (grpo.buffer) or asynchronous rollouts (grpo.async_staleness > 0) "
                      "store; accepted: '' (off), or a level with one of them")
  if g.async_staleness and g.buffer:
    raise ConfigError(f"config.grpo.async_staleness={g.async_staleness} overlaps generation with the update; "
                      "offline training (grpo.buffer) generates nothing: set async_staleness=0")
  if g.partial_rollouts:
    if g.async_staleness < 2:
      raise ConfigError(f"config.grpo.partial_rollouts=True spreads a rollout over the updates it is sampled across; "
                        f"with grpo.async_staleness={g.async_staleness} it spans at most one: set async_staleness >= 2 "
                        "(or partial_rollouts=False)")
    if env.name or a.estimator == "remax":
      what = f"env.name={env.name!r} (multi-turn episodes)" if env.name else "advantage.estimator='remax'"
      raise ConfigError(f"config.grpo.partial_rollouts=True with {what}: partial rollouts sample single-turn "
                        "responses; set partial_rollouts=False")
  if a.estimator == "remax" and g.buffer:
    raise ConfigError("config.advantage.estimator='remax' samples a greedy baseline response per prompt while "
                      "training; a replay buffer (grpo.buffer) has none: use online training or another estimator")
  if g.compact_sizes:
    unit = g.prompts_per_step // g.compact_sizes
    if not g.dynamic_sampling or unit < 1 or g.prompts_per_step % g.compact_sizes or unit % g.mini_batches:
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: needs grpo.dynamic_sampling=True (it leaves "
                        f"out the groups that dynamic sampling drops) and must divide prompts_per_step="
                        f"{g.prompts_per_step} into units of whole mini-batches (mini_batches={g.mini_batches}); "
                        "0 = off")
    if a.estimator not in GROUP_LOCAL_ESTIMATORS or loss.agg not in ("token-mean", "seq-mean-token-sum-norm"):
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes} with advantage.estimator={a.estimator!r}, "
                        f"policy_loss.agg={loss.agg!r}: leaving groups out keeps the loss unchanged only when each "
                        f"group's advantages depend on that group alone ({', '.join(GROUP_LOCAL_ESTIMATORS)}) and "
                        "the normaliser ignores masked-out rows (token-mean, seq-mean-token-sum-norm); set 0")
  if g.max_gen_batches > 1 and not g.dynamic_sampling:
    raise ConfigError(f"config.grpo.max_gen_batches={g.max_gen_batches}: must be >= 1, and > 1 (refilling) only "
                      "with grpo.dynamic_sampling=True")
  if env.name:
    if g.buffer:
      raise ConfigError("config.env.name: environments run online; a replay buffer (grpo.buffer) holds no episodes")
    if a.estimator == "remax":
      raise ConfigError("config.env.name with advantage.estimator='remax': the greedy baseline is one-turn only")
  mb_rows = rows // g.mini_batches
  if mb_rows % dp:
    raise ConfigError(f"config.grpo: {mb_rows} completions per mini-batch do not split over data-parallel size "
                      f"(data x fsdp x expert = {dp}); change grpo.prompts_per_step, sampling.num_samples, "
                      "grpo.mini_batches or mesh.shape")
  unit_rows = g.prompts_per_step // g.compact_sizes * s.num_samples // g.mini_batches if g.compact_sizes else 0
  if unit_rows % dp:
    raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: a size step of {unit_rows} completions per "
                      f"mini-batch does not split over data-parallel size (data x fsdp x expert = {dp}); use fewer sizes")


def check_policy(g: GrpoSection, model_cfg) -> None:
  """The grpo section's checks against the policy's architecture (`model_cfg`)."""
  if g.partial_rollouts and model_cfg.num_experts:
    raise ConfigError("config.grpo.partial_rollouts=True with an MoE policy: a response re-prefilled under new "
                      "weights would record the new policy's experts for its earlier tokens; set it False")
  if g.routing_replay and not model_cfg.num_experts:
    raise ConfigError(f"config.grpo.routing_replay: the policy ({model_cfg.model_type}) has no experts; "
                      "routing replay applies to Mixture-of-Experts models only")
