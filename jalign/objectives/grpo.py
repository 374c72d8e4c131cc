"""GRPO / PPO-style policy update on sampled sequences: clipped surrogate + KL to the reference + entropy bonus.

The batch is a `jalign.rl.batch.RolloutBatch` (its layout is documented there). Without `old_logp` the update is
on-policy (one epoch, one mini-batch): the old policy is the current one, so its log-probs are the current ones with
the gradient stopped (ratio 1, as verl does) and no separate forward is needed. Without `ref_logp`, as when the KL
coefficient is 0, the loss has no KL term and reports no KL. With a rollout correction (`rollout_is` / `rollout_rs`)
each token's clipped loss is weighted and masked by `losses.policy.rollout_correction` of `behaviour_logp` against
`kept_logp` where the sampler filtered its distribution (the old policy's log-probs renormalised over the same kept
set, `kept_logprobs`), else against `old_logp`. The loss comes back as (numerator, denominator) so the train step
normalises over the global batch.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jalign import kernels
from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.losses import policy
from jalign.objectives import router
from jalign.sampling.filters import filter_logits


@dataclasses.dataclass(frozen=True)
class PolicyLossSection:
  """The clipped policy update's loss (the run config's `policy_loss` section, read by GRPO and PPO)."""
  clip_low: float = bounded(0.2, ge=0)    # PPO clip: the ratio's lower bound is 1 - clip_low
  clip_high: float = 0.28                 # DAPO clip-higher (Yu et al. 2025); 0.2 = symmetric PPO
  clip_c: float | None = bounded(None, gt=1)  # dual clip (Ye et al. 2020); None = off
  # verl's loss_mode names; see losses.policy.policy_loss_matrix (clip_low / clip_high: log-ratio bounds for
  # geo_mean, divergence thresholds for dppo_*)
  mode: Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"] = "vanilla"
  tau_pos: float = bounded(1.0, gt=0)     # sapo's gate temperature where A > 0 (verl actor.tau_pos)
  tau_neg: float = bounded(1.05, gt=0)    # ... where A <= 0 (verl actor.tau_neg)
  # how token losses are averaged (verl loss_agg_mode; see losses.policy)
  agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
  loss_scale_factor: int = bounded(0, ge=0)  # seq-mean-token-sum-norm's constant T (verl's name); 0 = max_new_tokens
  entropy_coef: float = 0.0               # entropy bonus in the loss; 0 = off
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

  @property
  def corrects(self) -> bool:
    """A rollout correction is on."""
    return bool(self.rollout_is or self.rollout_rs)

  def check(self) -> None:
    if self.clip_high < self.clip_low:
      raise ConfigError(f"config.policy_loss.clip_high={self.clip_high} must be >= clip_low={self.clip_low}")
    if self.rollout_rs and self.rollout_rs_threshold_lower >= self.rollout_rs_threshold:
      raise ConfigError(f"config.policy_loss.rollout_rs_threshold_lower={self.rollout_rs_threshold_lower} must be "
                        f"below rollout_rs_threshold={self.rollout_rs_threshold}")

  def loss_config(self, *, kl_coef: float, kl_kind: str, temperature: float, group_size: int,
                  norm_rows: int, router_loss: router.RouterLoss = router.RouterLoss(rl=True)) -> "GrpoLossConfig":
    """The loss function's settings: this section's, the KL term's (`kl_coef` 0 = none), the sampling temperature,
    the update's layout and an MoE model's router terms."""
    return GrpoLossConfig(
        clip_low=self.clip_low, clip_high=self.clip_high, clip_c=self.clip_c, mode=self.mode, agg=self.agg,
        kl_coef=kl_coef, kl_kind=kl_kind, entropy_coef=self.entropy_coef, temperature=temperature,
        group_size=group_size, rollout_is=self.rollout_is, rollout_is_threshold=self.rollout_is_threshold,
        rollout_rs=self.rollout_rs, rollout_rs_threshold=self.rollout_rs_threshold,
        rollout_rs_threshold_lower=self.rollout_rs_threshold_lower, norm_rows=norm_rows, tau_pos=self.tau_pos,
        tau_neg=self.tau_neg, horizon=self.loss_scale_factor, router=router_loss)


@dataclasses.dataclass(frozen=True)
class GrpoLossConfig:
  clip_low: float = 0.2
  clip_high: float = 0.28
  clip_c: float | None = None
  mode: str = "vanilla"              # one of losses.policy.POLICY_MODES
  tau_pos: float = 1.0               # sapo's gate temperatures
  tau_neg: float = 1.05
  agg: str = "token-mean"
  kl_coef: float = 0.001
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  temperature: float = 1.0
  global_rows: int = 0               # rows per optimizer step, all micro-batches and shards (0: this batch's)
  norm_rows: int = 0                 # seq-mean-token-sum-norm's B (0: global_rows); see losses.policy
  horizon: int = 0                   # seq-mean-token-sum-norm's T (0: the padded response length)
  group_size: int = 0                # > 1: rows come in groups of this many samples of one prompt (see below)
  rollout_is: str = ""               # "token" / "sequence": truncated importance weights against `behaviour_logp`
  rollout_is_threshold: float = 2.0
  rollout_rs: str = ""               # "token" / "sequence" / "geometric": mask what strays outside the bounds
  rollout_rs_threshold: float = 2.0
  rollout_rs_threshold_lower: float = 0.5
  router: router.RouterLoss = router.RouterLoss(rl=True)  # MoE: the router terms' coefficients (0 by default)

  @property
  def corrects(self) -> bool:
    return bool(self.rollout_is or self.rollout_rs)


def response_logprobs(graphdef, params, batch, temperature: float,
                      logprobs: kernels.LogprobOptions = kernels.LogprobOptions(), group_size: int = 0):
  """(logp [N, R], entropy [N, R]) of the response tokens under the model at `params`. `group_size` > 1: rows
  i*g .. i*g+g-1 share one prompt (as sampled: each prompt's samples in a row), which then runs through the model
  once per group (`Decoder.response_hidden`). A batch with `routes` (routing replay) routes by them."""
  return _routed_logprobs(nnx.merge(graphdef, params), batch, temperature, logprobs, group_size)[:2]


def _routed_logprobs(lm, batch, temperature: float, logprobs: kernels.LogprobOptions, group_size: int):
  """`response_logprobs` and an MoE model's `Routing` (None for a dense one)."""
  hidden, routing = lm.response_routed(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                                      response_len=batch.response.shape[1], group_size=group_size,
                                      dropout_rng=batch.dropout_rng, routes_NxTxLxK=batch.routes)
  logp, entropy, _ = kernels.token_logprobs(hidden, lm.unembed(), batch.response,
                                            temperature=temperature, softcap=lm.cfg.final_softcap,
                                            **logprobs.kwargs())
  return logp, entropy, routing


def kept_logprobs(graphdef, params, batch, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0, group_size: int = 0):
  """Log-probs [N, R] of the response tokens under the model with the sampler's filters (top-k, top-p, min-p) applied
  to its own logits and renormalised over the tokens they keep: the distribution the sampler's behaviour log-probs
  are of, so an importance ratio compares like with like (against the full softmax it would be off by the kept mass;
  TRL#6789). Row by row: a row's [R, V] logits are the largest array."""
  lm = nnx.merge(graphdef, params)
  hidden = lm.response_hidden(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                              response_len=batch.response.shape[1], group_size=group_size,
                              routes_NxTxLxK=batch.routes)

  def row(args):
    hidden_RxD, tokens_R = args
    logits = filter_logits(lm.logits(hidden_RxD[None])[0], temperature=temperature, top_k=top_k, top_p=top_p,
                           min_p=min_p)
    return jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens_R[:, None], -1)[:, 0]
  return jax.lax.map(row, (hidden, batch.response))


def routing_mismatch(graphdef, params, batch, routes_NxTxLxK, *, replay: bool, group_size: int = 0):
  """(recorded expert choices the policy's router would not make, recorded choices) over the real tokens of `batch`
  and all layers: the sampler's experts `routes_NxTxLxK` against the router's own, on the hidden states of a forward
  that routes by them (`replay`) or by its own choices."""
  lm = nnx.merge(graphdef, params)
  _, routing = lm.response_routed(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                                  response_len=batch.response.shape[1], group_size=group_size,
                                  routes_NxTxLxK=routes_NxTxLxK, replay=replay)
  return jnp.sum(routing.mismatch_sum), jnp.sum(routing.recorded) * lm.cfg.experts_per_token


def make_loss_fn(graphdef, cfg: GrpoLossConfig, logprobs: kernels.LogprobOptions = kernels.LogprobOptions()):
  def loss_fn(params, batch):
    lm = nnx.merge(graphdef, params)
    logp, entropy, routing = _routed_logprobs(lm, batch, cfg.temperature, logprobs, cfg.group_size)
    mask = batch.response_mask.astype(jnp.float32)
    old_logp = batch.old_logp if batch.old_logp is not None else jax.lax.stop_gradient(logp)
    if cfg.corrects:
      weights, keep = policy.rollout_correction(
          old_logp if batch.kept_logp is None else batch.kept_logp, batch.behaviour_logp, mask, is_level=cfg.rollout_is,
          is_threshold=cfg.rollout_is_threshold, rs_level=cfg.rollout_rs, rs_upper=cfg.rollout_rs_threshold,
          rs_lower=cfg.rollout_rs_threshold_lower)
      response_mask = mask
      mask = mask * keep  # verl: rejected tokens leave the loss and its denominator
    pg, metrics = policy.policy_loss_matrix(logp, old_logp, batch.advantages, mask,
                                            clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=cfg.clip_c,
                                            mode=cfg.mode, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
    if cfg.corrects:
      pg = pg * weights
    kl = None if batch.ref_logp is None else policy.kl_penalty(logp, batch.ref_logp, cfg.kl_kind)
    total = (pg if kl is None else pg + cfg.kl_coef * kl) - cfg.entropy_coef * entropy
    agg = "seq-mean-token-mean" if cfg.mode in policy.SEQUENCE_MODES else cfg.agg
    norm = dict(global_rows=cfg.global_rows or None, norm_rows=cfg.norm_rows or None, horizon=cfg.horizon or None)
    num, den = policy.aggregate_parts(total, mask, agg, **norm)
    # Metric sums: each divided by the step's summed denominator, so token-mean metrics come out as global means.
    per_token = den / jnp.maximum(jnp.sum(mask), 1.0)
    sums = {"actor/pg_loss": policy.aggregate_parts(pg, mask, agg, **norm)[0],
            "actor/entropy": jnp.sum(entropy * mask) * per_token,
            "actor/pg_clipfrac": metrics["pg_clipfrac"] * den, "actor/ppo_kl": metrics["ppo_kl"] * den}
    if cfg.rollout_is:  # verl's names; the mean is of the truncated weights, the fraction of those at the cap
      sums["mismatch/rollout_is_mean"] = jnp.sum(weights * mask) * per_token
      sums["mismatch/rollout_is_ratio_fraction_high"] = jnp.sum((weights >= cfg.rollout_is_threshold) * mask) * \
          per_token
    if cfg.rollout_rs:  # the share of the response tokens masked out
      sums["mismatch/rollout_rs_masked_fraction"] = jnp.sum((1.0 - keep) * response_mask) * den / jnp.maximum(
          jnp.sum(response_mask), 1.0)
    if kl is not None:
      sums["actor/kl_loss"] = jnp.sum(kl * mask) * per_token
    if routing is not None:  # MoE: the router's terms over the forward's tokens (prompts once per shared group)
      penalty, moe = router.terms(routing, lm.cfg, cfg.router)
      num = num + penalty * den
      sums.update({k: v * den for k, v in moe.items()})
    return num, den, sums
  return loss_fn
