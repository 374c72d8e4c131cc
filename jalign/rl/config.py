"""GRPO / PPO's settings (the run config's `grpo` section): the prompts or replay buffer, the advantage estimator,
the clipped update and its loss, KL control, DAPO's dynamic sampling, the critic and the run's monitors."""
from __future__ import annotations

import dataclasses
from typing import Literal

from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.rl.rollout import SamplingSection

# Advantage estimators whose values for one group depend on that group's samples alone (no batch whitening, no
# critic): leaving other groups out of the batch does not change them.
GROUP_LOCAL_ESTIMATORS = ("grpo", "drgrpo", "rloo", "remax")


@dataclasses.dataclass(frozen=True)
class GrpoSection:
  prompts: str = ""                       # training prompts (same specs as data.train)
  buffer: str = ""                        # offline mode: a replay buffer directory from the rollout task
  prompts_per_step: int = bounded(16, gt=0)  # x sampling.num_samples completions per step
  mini_batches: int = bounded(1, gt=0)    # optimizer updates per epoch over the step's completions
  ppo_epochs: int = bounded(1, gt=0)      # passes over the step's completions
  # grpo / drgrpo / rloo: group baselines; gae: PPO with a learned critic; reinforce_pp(_baseline): REINFORCE++;
  # remax: each prompt's greedy response, sampled and scored alongside, is the baseline (Li et al. 2023).
  adv_estimator: Literal["grpo", "drgrpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline",
                         "remax"] = "grpo"
  gamma: float = bounded(1.0, ge=0, le=1)  # discount (verl algorithm.gamma)
  lam: float = bounded(1.0, ge=0, le=1)   # GAE lambda (verl algorithm.lam)
  clip_low: float = bounded(0.2, ge=0)    # PPO clip: the ratio's lower bound is 1 - clip_low
  clip_high: float = 0.28                 # DAPO clip-higher (Yu et al. 2025); 0.2 = symmetric PPO
  clip_c: float | None = bounded(None, gt=1)  # dual clip (Ye et al. 2020); None = off
  # verl's loss_mode names; see losses.policy.policy_loss_matrix (clip_low / clip_high: log-ratio bounds for
  # geo_mean, divergence thresholds for dppo_*)
  loss_mode: Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"] = "vanilla"
  tau_pos: float = bounded(1.0, gt=0)     # sapo's gate temperature where A > 0 (verl actor.tau_pos)
  tau_neg: float = bounded(1.05, gt=0)    # ... where A <= 0 (verl actor.tau_neg)
  # how token losses are averaged (verl loss_agg_mode; see losses.policy)
  agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
  loss_scale_factor: int = bounded(0, ge=0)  # seq-mean-token-sum-norm's constant T (verl's name); 0 = max_new_tokens
  kl_coef: float = 0.001                  # KL(pi || ref) in the loss (verl use_kl_loss, low_var_kl); 0 = no KL term
                                          # (DAPO): the reference then runs only on the steps that log the KL
  kl_kind: Literal["k1", "abs", "k2", "k3"] = "k3"  # KL estimator (Schulman's k1 / k2 / k3; abs)
  kl_in_reward: bool = False              # subtract kl_coef x KL(old || ref) from token rewards instead (verl
                                          # use_kl_in_reward); the KL loss term is then off
  kl_ctrl: Literal["fixed", "adaptive"] = "fixed"  # adaptive (Ziegler et al. 2019) steers the in-reward kl_coef
  kl_target: float = bounded(0.1, gt=0)   # adaptive: target KL per token (verl kl_ctrl.target_kl)
  kl_horizon: int = bounded(10000, gt=0)  # adaptive: horizon in rollouts (verl kl_ctrl.horizon)
  entropy_coef: float = 0.0               # entropy bonus in the loss; 0 = off
  critic_lr: float = 1e-5                 # gae: the critic's own AdamW learning rate (verl critic.optim.lr)
  value_clip: float = bounded(0.5, gt=0)  # gae: clip of the value update around the rollout values (verl)
  critic_warmup: int = bounded(0, ge=0)   # gae: first steps update only the critic (verl trainer.critic_warmup)
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
  max_kl: float = bounded(0.0, ge=0)      # bound on the mean KL to the reference; 0 = off
  max_kl_action: Literal["stop", "lower_lr"] = "stop"  # past max_kl: checkpoint and stop, or lower the lr
  kl_lr_factor: float = bounded(0.5, gt=0, lt=1)  # lower_lr: multiply the learning rate by this at each breach
  entropy_floor: float = 0.01             # warn (monitor/entropy_collapse) below this mean token entropy; 0 = off
  # a step whose advantages are all 0 (every group's rewards equal) carries no signal: "skip" leaves its update out
  # (the KL / entropy terms alone would only pull the policy toward the reference), "update" runs it as peers do
  no_signal: Literal["skip", "update"] = "skip"
  no_signal_warn_steps: int = bounded(5, ge=0)  # warn once when the run's first N steps all carried no signal; 0 = off
  # Rollout corrections for data sampled by an older or different policy (offline buffers, asynchronous rollouts),
  # by verl's names (algorithm.rollout_correction, 0.6): the clipped ratio is then taken against the policy as it was
  # before the step's update, and `rollout_is` weights each token's loss by the truncated importance ratio to the
  # behaviour policy (per token: TIS, Yao et al. 2025; or per sequence), `rollout_rs` masks tokens or whole
  # responses whose ratio (per token, sequence product, or geometric mean) leaves [threshold_lower, threshold].
  # Both "" = off: the clipped ratio is taken against the behaviour log-probs themselves.
  rollout_is: Literal["", "token", "sequence"] = ""
  rollout_is_threshold: float = bounded(2.0, gt=0)  # rollout_is: the weights' cap
  # rejection sampling: mask tokens or responses whose ratio leaves the thresholds; "" = off
  rollout_rs: Literal["", "token", "sequence", "geometric"] = ""
  rollout_rs_threshold: float = bounded(2.0, gt=0)  # rollout_rs: upper bound of the ratio
  rollout_rs_threshold_lower: float = bounded(0.5, gt=0)  # rollout_rs: lower bound of the ratio
  # Asynchronous GRPO/PPO: step t trains on rollouts sampled by the policy of k updates before (version t-1-k), so
  # the rollouts of steps t+1..t+k are generated while step t updates. Exactly k (not "up to k"), so a run is the
  # same however the threads interleave and resumes bitwise (the in-flight rollouts are checkpointed). The stored
  # sampler log-probs are the behaviour policy's: the clipped ratio is taken against them, or with a rollout
  # correction (rollout_is / rollout_rs) against the policy before the update. 0 = synchronous.
  async_staleness: int = bounded(0, ge=0)
  # Sampling on devices of its own: a ('data', 'fsdp', 'tensor') mesh over each process's last devices (its product
  # a multiple of the process count), the training mesh (mesh.shape) over the rest; the policy's weights are copied
  # across when a rollout is submitted. With async_staleness the update and the generation then run side by side
  # rather than interleaved on shared devices. () = sampling on the training mesh.
  rollout_mesh: tuple[int, ...] = ()
  # Multi-turn: each sample is an episode of this environment (jalign.rl.agentic.env: "calculator", "python", "answer"),
  # turn by turn (sampling.max_new_tokens per turn), its final answer scored by the first verifiable reward of
  # reward.weights; "" = one turn, scored by the whole reward section.
  env: str = ""
  env_max_turns: int = bounded(4, gt=0)   # turns per episode before it is cut
  # How the model writes tool calls: hermes (Qwen), llama3 (JSON), mistral ([TOOL_CALLS]), compact (<<argument>>,
  # one tool with one argument: for small models and short contexts)
  env_tool_format: Literal["hermes", "llama3", "mistral", "compact"] = "hermes"
  env_max_tokens: int = bounded(0, ge=0)  # an episode's token budget, prompt included; 0 = the model's context
  # A turn's reward per failed tool call (malformed, unknown tool, bad arguments, an error): shaping on that turn's
  # last token, added to the episode's return; 0 = the final answer's score alone
  env_error_reward: float = bounded(0.0, ge=-1, le=0)

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per training step (policy and critic alike)."""
    return self.mini_batches * self.ppo_epochs

  def check(self, s: SamplingSection, task: str, dp: int) -> None:
    """The checks across GRPO's keys, the sampling section's and the data-parallel size `dp`."""
    g = self
    if not g.prompts and not g.buffer:
      raise ConfigError("config.grpo.prompts: empty; give a prompt file/glob, tfds:... or synthetic:TASK:SPLIT "
                        "(or grpo.buffer for offline training)")
    if s.num_samples < 2 and g.adv_estimator in ("grpo", "rloo"):
      raise ConfigError(f"config.sampling.num_samples={s.num_samples}: {g.adv_estimator} compares completions of "
                        "the same prompt and needs at least 2")
    rows = g.prompts_per_step * s.num_samples
    if rows % g.mini_batches:
      raise ConfigError(f"config.grpo.mini_batches={g.mini_batches} does not divide the {rows} completions per step "
                        f"(grpo.prompts_per_step x sampling.num_samples)")
    if g.clip_high < g.clip_low:
      raise ConfigError(f"config.grpo.clip_high={g.clip_high} must be >= clip_low={g.clip_low}")
    if s.temperature == 0:
      raise ConfigError("config.sampling.temperature=0: GRPO needs sampled (not greedy) completions")
    if task == "ppo" and g.adv_estimator != "gae":
      raise ConfigError(f"config.grpo.adv_estimator={g.adv_estimator!r}: task 'ppo' trains a critic for GAE; set "
                        "'gae' (or use task 'grpo' for critic-free estimators)")
    if g.kl_ctrl == "adaptive" and not g.kl_in_reward:
      raise ConfigError("config.grpo.kl_ctrl='adaptive' steers the KL subtracted from the reward; set "
                        "grpo.kl_in_reward=True (or kl_ctrl='fixed')")
    if g.dynamic_sampling and s.num_samples < 2:
      raise ConfigError(f"config.grpo.dynamic_sampling=True drops groups whose rewards are all equal: with "
                        f"sampling.num_samples={s.num_samples} every group would be dropped; set num_samples >= 2 or "
                        "dynamic_sampling=False")
    if (g.rollout_is or g.rollout_rs) and not (g.buffer or g.async_staleness):
      key = f"rollout_is={g.rollout_is!r}" if g.rollout_is else f"rollout_rs={g.rollout_rs!r}"
      raise ConfigError(f"config.grpo.{key}: rollout corrections need behaviour log-probs of an older policy, "
                        "which a replay buffer (grpo.buffer) or asynchronous rollouts (grpo.async_staleness > 0) "
                        "store; accepted: '' (off), or a level with one of them")
    if g.rollout_rs and g.rollout_rs_threshold_lower >= g.rollout_rs_threshold:
      raise ConfigError(f"config.grpo.rollout_rs_threshold_lower={g.rollout_rs_threshold_lower} must be below "
                        f"rollout_rs_threshold={g.rollout_rs_threshold}")
    if g.async_staleness and g.buffer:
      raise ConfigError(f"config.grpo.async_staleness={g.async_staleness} overlaps generation with the update; "
                        "offline training (grpo.buffer) generates nothing: set async_staleness=0")
    if g.adv_estimator == "remax" and g.buffer:
      raise ConfigError("config.grpo.adv_estimator='remax' samples a greedy baseline response per prompt while "
                        "training; a replay buffer (grpo.buffer) has none: use online training or another estimator")
    if g.compact_sizes:
      unit = g.prompts_per_step // g.compact_sizes
      if not g.dynamic_sampling or unit < 1 or g.prompts_per_step % g.compact_sizes or unit % g.mini_batches:
        raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: needs grpo.dynamic_sampling=True (it leaves "
                          f"out the groups that dynamic sampling drops) and must divide prompts_per_step="
                          f"{g.prompts_per_step} into units of whole mini-batches (mini_batches={g.mini_batches}); "
                          "0 = off")
      if g.adv_estimator not in GROUP_LOCAL_ESTIMATORS or g.agg not in ("token-mean", "seq-mean-token-sum-norm"):
        raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes} with adv_estimator={g.adv_estimator!r}, "
                          f"agg={g.agg!r}: leaving groups out keeps the loss unchanged only when each group's "
                          f"advantages depend on that group alone ({', '.join(GROUP_LOCAL_ESTIMATORS)}) and the "
                          "normaliser ignores masked-out rows (token-mean, seq-mean-token-sum-norm); set 0")
    if g.max_gen_batches > 1 and not g.dynamic_sampling:
      raise ConfigError(f"config.grpo.max_gen_batches={g.max_gen_batches}: must be >= 1, and > 1 (refilling) only "
                        "with grpo.dynamic_sampling=True")
    if g.env:
      from jalign.rl.agentic.env import REGISTRY as ENVIRONMENTS
      if g.env not in ENVIRONMENTS:
        raise ConfigError(f"config.grpo.env={g.env!r}: unknown environment; registered: "
                          f"{', '.join(sorted(ENVIRONMENTS))}")
      if g.buffer:
        raise ConfigError("config.grpo.env: environments run online; a replay buffer (grpo.buffer) holds no episodes")
      if g.adv_estimator == "remax":
        raise ConfigError("config.grpo.env with adv_estimator='remax': the greedy baseline is one-turn only")
    mb_rows = rows // g.mini_batches
    if mb_rows % dp:
      raise ConfigError(f"config.grpo: {mb_rows} completions per mini-batch do not split over data-parallel size "
                        f"(data x fsdp = {dp}); change grpo.prompts_per_step, sampling.num_samples, "
                        "grpo.mini_batches or mesh.shape")
    unit_rows = g.prompts_per_step // g.compact_sizes * s.num_samples // g.mini_batches if g.compact_sizes else 0
    if unit_rows % dp:
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: a size step of {unit_rows} completions per "
                        f"mini-batch does not split over data-parallel size (data x fsdp = {dp}); use fewer sizes")
