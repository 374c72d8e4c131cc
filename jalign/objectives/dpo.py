"""DPO-family objective on preference batches [B, 2, L] (chosen, rejected): summed completion log-probs of the
policy (and, from the batch, of the reference) -> `losses.dpo`. Metrics use TRL's names.

`rpo_alpha` adds RPO's NLL on the chosen completions (Pang et al. 2024), as TRL's `"sft"` loss term: the token mean
over the batch's chosen tokens, weighted by alpha.
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
from jalign.losses import dpo as dpo_losses
from jalign.objectives import router
from jalign.objectives.sft import targets_and_weights


@dataclasses.dataclass(frozen=True)
class DpoLossConfig:
  loss_type: str = "sigmoid"
  beta: float = 0.1
  label_smoothing: float = 0.0
  simpo_gamma: float = 0.5
  cpo_alpha: float = 1.0
  discopop_tau: float = 0.05
  rpo_alpha: float = 0.0
  desirable_weight: float = 1.0      # KTO
  undesirable_weight: float = 1.0
  router: router.RouterLoss = router.RouterLoss()  # MoE: the router terms (the checkpoint's load balancing, as SFT)


def sequence_logps(graphdef, params, batch: dict, *, logprobs: kernels.LogprobOptions = kernels.LogprobOptions()):
  """(summed completion log-probs [B, 2], completion token counts [B, 2], per-token log-probs [2B, L'] with their
  weights, an MoE model's `Routing` or None) of a pair batch under the model at `params`. A batch in the split
  layout (`prompt_mask`, see `data.preference.split_pair_batch`) runs each pair's prompt once, under both
  completions."""
  b, two, length = batch["tokens"].shape
  flat = {k: batch[k].reshape(b * two, length) for k in ("tokens", "loss_mask", "segment_ids", "positions")}
  lm = nnx.merge(graphdef, params)
  if "prompt_mask" in batch:
    p = batch["prompt_mask"].shape[1]
    hidden, routing = lm.response_routed(flat["tokens"], segment_ids=flat["segment_ids"],
                                         positions=flat["positions"], response_len=length - p, group_size=two,
                                         dropout_rng=batch.get("dropout_rng"))
    targets, weights = flat["tokens"][:, p:], flat["loss_mask"][:, p:].astype(jnp.float32)
  else:
    hidden, _, routing = lm.forward_routed(flat["tokens"], segment_ids=flat["segment_ids"],
                                           positions=flat["positions"], dropout_rng=batch.get("dropout_rng"))
    targets, weights = targets_and_weights(flat)
  logp, _, _ = kernels.token_logprobs(hidden, lm.unembed(), targets, softcap=lm.cfg.final_softcap,
                                      **logprobs.kwargs())
  sums = jnp.sum(logp * weights, axis=-1).reshape(b, two)
  counts = jnp.sum(weights, axis=-1).reshape(b, two)
  return sums, counts, (logp, weights), routing


def make_kto_loss_fn(graphdef, cfg: DpoLossConfig, *, logprobs: kernels.LogprobOptions = kernels.LogprobOptions()):
  """KTO on a `kto_batch` [N, 2, L] (0 = the example, 1 = its mismatched KL sequence). The KL sequences go through
  the policy with the gradient stopped (a separate forward, so no backward runs over them), as TRL does under
  no_grad; their mean log-ratio, clamped at 0, is the reference point. Loss: mean over the N examples."""
  def loss_fn(params, batch):
    example = {k: v[:, :1] for k, v in batch.items() if k in ("tokens", "loss_mask", "segment_ids", "positions")}
    mismatched = {k: v[:, 1:] for k, v in batch.items() if k in ("tokens", "loss_mask", "segment_ids", "positions")}
    logps, _, _, routing = sequence_logps(graphdef, params, example, logprobs=logprobs)
    logps = logps[:, 0]
    kl_logps = sequence_logps(graphdef, jax.lax.stop_gradient(params), mismatched, logprobs=logprobs)[0][:, 0]
    desirable = batch["label"] > 0
    losses, rewards, kl = dpo_losses.kto_loss(logps, batch["ref_logps"], desirable, kl_logps, batch["ref_kl_logps"],
                                              beta=cfg.beta, desirable_weight=cfg.desirable_weight,
                                              undesirable_weight=cfg.undesirable_weight)
    n = jnp.asarray(losses.shape[0], jnp.float32)
    d = desirable.astype(jnp.float32)
    # Class means within the batch, scaled by N so the step's division by N leaves the mean.
    mean_of = lambda x, w: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0) * n
    sums = {"kl": kl * n, "rewards/chosen": mean_of(rewards, d), "rewards/rejected": mean_of(rewards, 1 - d),
            "logps/chosen": mean_of(jax.lax.stop_gradient(logps), d),
            "logps/rejected": mean_of(jax.lax.stop_gradient(logps), 1 - d)}
    sums["rewards/margins"] = sums["rewards/chosen"] - sums["rewards/rejected"]
    return _with_router(jnp.sum(losses), n, sums, routing, nnx.merge(graphdef, params).cfg, cfg.router)
  return loss_fn


def make_loss_fn(graphdef, cfg: DpoLossConfig, *, logprobs: kernels.LogprobOptions = kernels.LogprobOptions()):
  if cfg.loss_type == "kto":
    return make_kto_loss_fn(graphdef, cfg, logprobs=logprobs)

  def loss_fn(params, batch):
    logps, counts, (token_logp, weights), routing = sequence_logps(graphdef, params, batch, logprobs=logprobs)
    c, r = logps[:, 0], logps[:, 1]
    nc, nr = counts[:, 0], counts[:, 1]
    chosen_nll = -c / jnp.maximum(nc, 1.0)
    t = cfg.loss_type
    if t == "simpo":
      losses, rc, rr = dpo_losses.simpo_loss(c, r, nc, nr, beta=cfg.beta, gamma=cfg.simpo_gamma,
                                             label_smoothing=cfg.label_smoothing)
    elif t == "cpo":
      losses, rc, rr = dpo_losses.cpo_loss(c, r, chosen_nll, beta=cfg.beta, alpha=cfg.cpo_alpha,
                                           label_smoothing=cfg.label_smoothing)
    elif t == "orpo":  # TRL's ORPOTrainer reports beta x average log-probs as rewards
      losses, _ = dpo_losses.orpo_loss(c, r, nc, nr, chosen_nll, lam=cfg.beta)
      rc, rr = cfg.beta * c / jnp.maximum(nc, 1.0), cfg.beta * r / jnp.maximum(nr, 1.0)
    else:
      losses, rc, rr = dpo_losses.dpo_loss(c, r, batch["ref_chosen_logps"], batch["ref_rejected_logps"],
                                           beta=cfg.beta, loss_type=t, label_smoothing=cfg.label_smoothing,
                                           chosen_lengths=nc, rejected_lengths=nr, discopop_tau=cfg.discopop_tau)
    pairs = losses.shape[0]
    loss_sum = jnp.sum(losses)
    sums = {}
    if cfg.rpo_alpha:
      chosen_w = weights.reshape(pairs, 2, -1)[:, 0]
      chosen_lp = token_logp.reshape(pairs, 2, -1)[:, 0]
      nll = -jnp.sum(chosen_lp * chosen_w) / jnp.maximum(jnp.sum(chosen_w), 1.0)
      loss_sum = loss_sum + cfg.rpo_alpha * nll * pairs  # the step divides by the pair count
      sums["nll_loss"] = nll * pairs
    rc, rr = jax.lax.stop_gradient(rc), jax.lax.stop_gradient(rr)
    sums.update({"rewards/chosen": jnp.sum(rc), "rewards/rejected": jnp.sum(rr),
                 "rewards/accuracies": jnp.sum((rc > rr).astype(jnp.float32)), "rewards/margins": jnp.sum(rc - rr),
                 "logps/chosen": jnp.sum(jax.lax.stop_gradient(c)),
                 "logps/rejected": jnp.sum(jax.lax.stop_gradient(r))})
    return _with_router(loss_sum, jnp.asarray(pairs, jnp.float32), sums, routing,
                        nnx.merge(graphdef, params).cfg, cfg.router)
  return loss_fn


def _with_router(loss_sum, count, sums: dict, routing, model_cfg, setting: router.RouterLoss):
  """An MoE model's router penalty (per example, like the loss) and metrics added to a loss's (sum, count, sums)."""
  if routing is None:
    return loss_sum, count, sums
  penalty, metrics = router.terms(routing, model_cfg, setting)
  return loss_sum + penalty * count, count, {**sums, **{k: v * count for k, v in metrics.items()}}


DPO_LOSS_TYPES = dpo_losses.PAIRED + dpo_losses.REFERENCE_FREE + ("kto",)


@dataclasses.dataclass(frozen=True)
class DpoSection:
  loss_type: Literal[DPO_LOSS_TYPES] = "sigmoid"  # simpo / cpo / orpo need no reference model
  beta: float = bounded(0.1, gt=0)        # (orpo: lambda; simpo: its beta, ~2)
  label_smoothing: float = bounded(0.0, ge=0, lt=0.5)  # sigmoid: conservative DPO; robust / exo_pair: the noise level
  simpo_gamma: float = 0.5                # SimPO target reward margin
  cpo_alpha: float = 1.0                  # CPO: weight of the chosen NLL
  discopop_tau: float = 0.05              # discopop: the temperature of its mix of logistic and exponential losses
  rpo_alpha: float = bounded(0.0, ge=0)   # RPO (Pang et al. 2024): + alpha x token-mean NLL of the chosen; 0 = off
  desirable_weight: float = bounded(1.0, gt=0)  # KTO (unpaired prompt/completion/label data, or pairs split in two)
  undesirable_weight: float = bounded(1.0, gt=0)  # KTO: weight of the undesirable examples' loss
  precompute_ref_logps: bool = False      # one reference pass over the data before training, then no reference forward
  share_prompt: bool = True               # each pair's prompt runs once, under both completions (prefix sharing)
  sync_ref_model: bool = False            # TR-DPO (Gorbatovski et al. 2024): ref = a * policy + (1 - a) * ref ...
  ref_model_mixup_alpha: float = 0.6      # TR-DPO: reference <- alpha x policy + (1 - alpha) x reference at each sync
  ref_model_sync_steps: int = 512         # ... every this many steps
  eval_prompts: str = ""                  # held-out prompts for greedy task accuracy (needs a ground truth); "" = none
  eval_examples: int = bounded(500, ge=0)  # held-out prompts for greedy accuracy (the first N of eval_prompts)
  eval_max_new_tokens: int = 16           # tokens generated per held-out prompt

  def check(self) -> None:
    p = self
    if p.loss_type == "exo_pair" and not 0 < p.label_smoothing < 1:
      raise ConfigError("config.dpo.label_smoothing: loss_type 'exo_pair' needs 0 < label_smoothing < 1 (e.g. 1e-3)")
    if p.loss_type == "kto":
      if p.precompute_ref_logps:
        raise ConfigError("config.dpo.precompute_ref_logps=True: KTO's KL sequences pair each prompt with another "
                          "example's completion of the same batch, so their reference log-probs depend on batching; "
                          "set precompute_ref_logps=False")
      if p.rpo_alpha:
        raise ConfigError("config.dpo.rpo_alpha applies to paired losses, not loss_type='kto'")
    if p.sync_ref_model:
      if p.precompute_ref_logps:
        raise ConfigError("config.dpo.sync_ref_model=True with precompute_ref_logps=True: precomputed reference "
                          "log-probs go stale when the reference is synced; set one of them to False")
      if not 0 < p.ref_model_mixup_alpha <= 1 or p.ref_model_sync_steps <= 0:
        raise ConfigError("config.dpo: sync_ref_model needs 0 < ref_model_mixup_alpha <= 1 and "
                          "ref_model_sync_steps > 0")
      if p.loss_type in dpo_losses.REFERENCE_FREE:
        raise ConfigError(f"config.dpo.sync_ref_model=True: loss_type {p.loss_type!r} uses no reference model")
