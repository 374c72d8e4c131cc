"""Policy-gradient losses, KL estimators and loss aggregation, as defined in verl's `core_algos.py`."""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from jalign.core.sections import bounded
from jalign.losses.advantages import masked_mean

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "abs", "k2", "k3")


@dataclasses.dataclass(frozen=True)
class KlSection:
  """The KL to the reference policy: in the loss or in the reward, its coefficient fixed or adaptive, and a bound on
  it (the run config's `kl` section, read by GRPO and PPO)."""
  coef: float = 0.001                     # KL(pi || ref) in the loss (verl use_kl_loss, low_var_kl); 0 = no KL term
                                          # (DAPO): the reference then runs only on the steps that log the KL
  kind: Literal["k1", "abs", "k2", "k3"] = "k3"  # KL estimator (Schulman's k1 / k2 / k3; abs)
  in_reward: bool = False                 # subtract coef x KL(old || ref) from token rewards instead (verl
                                          # use_kl_in_reward); the KL loss term is then off
  ctrl: Literal["fixed", "adaptive"] = "fixed"  # adaptive (Ziegler et al. 2019) steers the in-reward coef
  target: float = bounded(0.1, gt=0)      # adaptive: target KL per token (verl kl_ctrl.target_kl)
  horizon: int = bounded(10000, gt=0)     # adaptive: horizon in rollouts (verl kl_ctrl.horizon)
  max: float = bounded(0.0, ge=0)         # bound on the mean KL to the reference; 0 = off
  max_action: Literal["stop", "lower_lr"] = "stop"  # past kl.max: checkpoint and stop, or lower the lr
  lr_factor: float = bounded(0.5, gt=0, lt=1)  # lower_lr: multiply the learning rate by this at each breach

  @property
  def needs_reference(self) -> bool:
    """The reference policy's log-probs are read: by the loss's KL term, the reward's, or the bound."""
    return bool(self.coef) or self.in_reward or self.ctrl == "adaptive" or bool(self.max)


def aggregate_parts(loss_BxT, mask_BxT, mode: str, *, global_rows: int | None = None,
                    norm_rows: int | None = None, horizon: int | None = None):
  """(numerator, denominator) whose sums over micro-batches and data-parallel shards, divided, give `aggregate` of
  the whole global batch: the normaliser is global, not per micro-batch (a pitfall of per-shard means).

  `global_rows`: rows of the global batch, all pieces together (default: this piece's rows). What each mode divides
  the masked loss sum by, with B the global batch's sequences and T the padded response length:

    mode                     divides by                     matches
    token-mean               valid tokens                   verl agg_loss; TRL "dapo" / "bnpo" (global tokens)
    seq-mean-token-sum       B (each row's token sum)       verl agg_loss
    seq-mean-token-mean      B (each row's token mean)      verl agg_loss; TRL "grpo"
    seq-mean-token-sum-norm  norm_rows x horizon            verl agg_loss since its Feb 2026 fix (global_batch_size
                                                            x loss_scale_factor); TRL "dr_grpo" (B x
                                                            max_completion_length)

  Dr. GRPO (Liu et al. 2025) wants a constant normaliser: `horizon` (verl's loss_scale_factor) defaults to T and
  `norm_rows` to B; a batch that leaves out whole masked rows (GRPO's compact_sizes) passes the B it stands for.
  Before Feb 2026 verl divided by T alone, B times the value here."""
  mask = mask_BxT.astype(jnp.float32)
  per_seq = jnp.sum(loss_BxT * mask, axis=-1)
  rows = loss_BxT.shape[0]
  share = rows / (global_rows or rows)   # this piece's part of a normaliser that counts the whole batch
  if mode == "token-mean":
    return jnp.sum(per_seq), jnp.sum(mask)
  if mode == "seq-mean-token-sum":
    return jnp.sum(per_seq), jnp.asarray(rows, jnp.float32)
  if mode == "seq-mean-token-mean":
    return jnp.sum(per_seq / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)), jnp.asarray(rows, jnp.float32)
  if mode == "seq-mean-token-sum-norm":
    norm = (norm_rows or global_rows or rows) * (horizon or loss_BxT.shape[-1])
    return jnp.sum(per_seq), jnp.asarray(norm * share, jnp.float32)
  raise ValueError(f"loss aggregation {mode!r}; accepted: {', '.join(AGG_MODES)}")


def aggregate(loss_BxT, mask_BxT, mode: str = "token-mean"):
  num, den = aggregate_parts(loss_BxT, mask_BxT, mode)
  return num / den


def kl_penalty(logp, ref_logp, kind: str = "k3"):
  """Per-token KL(pi || ref) estimators (Schulman, "Approximating KL divergence", 2020): k1 = log ratio, abs,
  k2 = half squared log ratio, k3 = exp(-x) + x - 1 with verl's clamps."""
  if kind == "k1":
    return logp - ref_logp
  if kind == "abs":
    return jnp.abs(logp - ref_logp)
  if kind == "k2":
    return 0.5 * jnp.square(logp - ref_logp)
  if kind == "k3":
    kl = jnp.clip(ref_logp - logp, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)
  raise ValueError(f"KL estimator {kind!r}; accepted: {', '.join(KL_KINDS)}")


# Policy-loss modes, named as verl's `policy_loss.loss_mode`. Those in SEQUENCE_MODES aggregate seq-mean-token-mean
# whatever `agg` says, as verl does (their objectives are defined per sequence).
POLICY_MODES = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")
SEQUENCE_MODES = ("gspo", "sapo", "geo_mean")


def policy_loss_matrix(logp, old_logp, adv, mask, *, clip_low: float = 0.2, clip_high: float = 0.2,
                       clip_c: float | None = None, mode: str = "vanilla", tau_pos: float = 1.0,
                       tau_neg: float = 1.05):
  """Per-token policy loss [B, T] and metrics (`pg_clipfrac`, `ppo_kl`), r = pi / pi_old per token.

  vanilla   PPO clip with separate low/high ranges (DAPO clip-higher) and, when `clip_c` is set, dual clip (Ye et
            al. 2020) bounding the loss of negative-advantage tokens by -A * clip_c.
  gspo      sequence-level ratio (mean token log-ratio, stop-gradient) times the token's own ratio, clipped (Zheng
            et al. 2025, arXiv:2507.18071).
  cispo     -sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi: the IS weight is clipped, never the gradient;
            REINFORCE on every token (MiniMax-M1, arXiv:2506.13585, eq. 4-5).
  sapo      -f(r) * A with the soft gate f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos where A > 0 else
            tau_neg, in place of a hard clip (Gao et al. 2025, arXiv:2511.20347; verl's defaults 1.0 / 1.05).
  geo_mean  GMPO: per sequence, -mean_t(A) * exp(mean_t(log r clipped to [-clip_low, clip_high] on the side the
            advantage's sign pushes)), the geometric mean of token ratios (Zhao et al. 2025, arXiv:2507.20673;
            the paper's range is (-0.4, 0.4) in log space; verl reads clip_ratio_low/high as it).
  dppo_tv   DPPO-Binary-TV: -A * sg(min(r, clip_c or 20)) * log pi on tokens whose probability moved by at most
            clip_high (A > 0: p - p_old <= clip_high) or clip_low (A <= 0: p - p_old >= -clip_low); the others
            are masked out of the gradient (arXiv:2602.04879; prime-rl's default style of trust region).
  dppo_kl   as dppo_tv with the binary KL(p_old || p) of the sampled token against the thresholds, masking only
            moves in the advantage's direction."""
  mask = mask.astype(jnp.float32)
  log_ratio = logp - old_logp
  metrics = {"ppo_kl": masked_mean(-log_ratio, mask)}
  if mode in ("vanilla", "gspo"):
    if mode == "vanilla":
      ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
    else:
      seq = jnp.sum(log_ratio * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
      log_seq_ratio = logp - jax.lax.stop_gradient(logp) + jax.lax.stop_gradient(seq)[:, None]
      ratio = jnp.exp(jnp.minimum(log_seq_ratio, 10.0))
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(loss1, loss2)
    metrics["pg_clipfrac"] = masked_mean((loss2 > loss1).astype(jnp.float32), mask)
    if mode == "vanilla" and clip_c is not None:
      loss3 = -adv * clip_c
      dual = jnp.minimum(loss3, clipped)
      metrics["pg_clipfrac_lower"] = masked_mean(((clipped > loss3) & (adv < 0)).astype(jnp.float32), mask)
      clipped = jnp.where(adv < 0, dual, clipped)
    return clipped, metrics
  ratio = jnp.exp(jnp.clip(log_ratio, -20.0, 20.0))
  if mode == "cispo":
    weight = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    metrics["pg_clipfrac"] = masked_mean((weight != ratio).astype(jnp.float32), mask)
    return -jax.lax.stop_gradient(weight) * adv * logp, metrics
  if mode == "sapo":
    tau = jnp.where(adv > 0, tau_pos, tau_neg)
    metrics["pg_clipfrac"] = jnp.zeros((), jnp.float32)
    return -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * adv, metrics
  if mode == "geo_mean":
    sign, bounded = jnp.sign(adv), jnp.clip(log_ratio, -clip_low, clip_high)
    kept = sign * jnp.minimum(sign * log_ratio, sign * bounded)
    n = jnp.sum(mask, -1)
    seq_ratio = jnp.exp(jnp.sum(kept * mask, -1) / (n + 1e-8))
    seq_adv = jnp.sum(adv * mask, -1) / (n + 1e-8)
    was_clipped = (log_ratio != bounded).astype(jnp.float32)
    metrics["pg_clipfrac"] = masked_mean(was_clipped * (adv > 0), mask)
    metrics["pg_clipfrac_lower"] = masked_mean(was_clipped * (adv < 0), mask)
    return jnp.broadcast_to((-seq_adv * seq_ratio)[:, None], logp.shape), metrics  # a sequence's loss on its tokens
  if mode in ("dppo_tv", "dppo_kl"):
    p, p_old = jnp.exp(logp), jnp.exp(old_logp)
    if mode == "dppo_tv":
      valid = jnp.where(adv > 0, p - p_old <= clip_high, p - p_old >= -clip_low)
    else:
      binary_kl = p_old * (old_logp - logp) + (1.0 - p_old) * jnp.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
      valid = jnp.where(adv > 0, (binary_kl <= clip_high) | (p <= p_old), (binary_kl <= clip_low) | (p >= p_old))
    valid = jax.lax.stop_gradient(valid.astype(jnp.float32))
    cap = 20.0 if clip_c is None else clip_c
    metrics["pg_clipfrac"] = masked_mean(1.0 - valid, mask)
    return -adv * jax.lax.stop_gradient(jnp.minimum(ratio, cap)) * logp * valid, metrics
  raise ValueError(f"policy loss mode {mode!r}; accepted: {', '.join(POLICY_MODES)}")


ROLLOUT_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")


def rollout_correction(old_logp, behaviour_logp, mask, *, is_level: str = "", is_threshold: float = 2.0,
                       rs_level: str = "", rs_upper: float = 2.0, rs_lower: float = 0.5):
  """Corrections for data sampled by another policy (verl's `algorithm.rollout_correction`, 0.6): importance weights
  and a keep mask [N, R], gradient stopped, from the log-ratio of the policy before the update to the behaviour
  policy. `is_level` (verl `rollout_is`): "token" = min(pi_old / pi_behaviour, threshold) per token (TIS; Yao et al.
  2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), "sequence" = min(prod over the
  response, threshold) on each of its tokens, "" = 1. `rs_level` (verl `rollout_rs`, masked importance sampling):
  tokens ("token"), or whole responses by the product ("sequence") or geometric mean ("geometric") of their
  ratios, outside [rs_lower, rs_upper] are masked out of the loss; "" keeps all."""
  log_ratio = jnp.clip(old_logp - behaviour_logp, -20.0, 20.0) * mask
  seq_log = jnp.sum(log_ratio, axis=-1, keepdims=True)
  weights = jnp.ones_like(log_ratio)
  if is_level == "token":
    weights = jnp.minimum(jnp.exp(log_ratio), is_threshold)
  elif is_level == "sequence":
    weights = jnp.broadcast_to(jnp.minimum(jnp.exp(jnp.clip(seq_log, -20.0, 20.0)), is_threshold), log_ratio.shape)
  elif is_level:
    raise ValueError(f"rollout_is {is_level!r}; accepted: {', '.join(ROLLOUT_LEVELS)} or ''")
  keep = jnp.ones_like(log_ratio)
  if rs_level:
    if rs_level not in ROLLOUT_RS_LEVELS:
      raise ValueError(f"rollout_rs {rs_level!r}; accepted: {', '.join(ROLLOUT_RS_LEVELS)} or ''")
    by = {"token": log_ratio, "sequence": seq_log,
          "geometric": seq_log / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)}[rs_level]
    inside = (by >= jnp.log(rs_lower)) & (by <= jnp.log(rs_upper))
    keep = jnp.broadcast_to(inside, log_ratio.shape).astype(log_ratio.dtype)
  return jax.lax.stop_gradient(weights), jax.lax.stop_gradient(keep)


def policy_loss(logp, old_logp, adv, mask, *, agg: str = "token-mean", mode: str = "vanilla", **mode_args):
  """Aggregated policy loss (SEQUENCE_MODES always seq-mean-token-mean, as verl does) and metrics."""
  loss, metrics = policy_loss_matrix(logp, old_logp, adv, mask, mode=mode, **mode_args)
  return aggregate(loss, mask, "seq-mean-token-mean" if mode in SEQUENCE_MODES else agg), metrics


def value_loss(values_pred, returns, values_old, mask, *, clip: float, agg: str = "token-mean"):
  """Clipped value loss: 0.5 * agg(max((v - R)^2, (clip(v, v_old +- clip) - R)^2)) and the clipped fraction."""
  clipped = jnp.clip(values_pred, values_old - clip, values_old + clip)
  l1, l2 = (values_pred - returns) ** 2, (clipped - returns) ** 2
  return 0.5 * aggregate(jnp.maximum(l1, l2), mask, agg), masked_mean((l2 > l1).astype(jnp.float32), mask)


class AdaptiveKL:
  """Adaptive KL coefficient (Ziegler et al. 2019): proportional error clipped to +-0.2, scaled by steps/horizon."""

  def __init__(self, init: float, target: float, horizon: int):
    if horizon <= 0:
      raise ValueError(f"adaptive KL horizon must be positive, got {horizon}")
    self.value, self.target, self.horizon = init, target, horizon

  def update(self, current_kl: float, n_steps: int) -> float:
    error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
    self.value *= 1.0 + error * n_steps / self.horizon
    return self.value
