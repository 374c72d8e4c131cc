"""Direct preference losses on sequence log-probabilities, per pair (or per example for KTO).

Definitions follow TRL's `DPOTrainer` (loss types), `CPOTrainer` (SimPO, CPO), `ORPOTrainer` and `KTOTrainer`, with
the papers cited per type. Inputs are summed sequence log-probs [B]; `chosen_lengths`/`rejected_lengths` (token
counts) are needed by the length-normalised types (ipo, sigmoid_norm, simpo, orpo).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

PAIRED = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
          "discopop", "sigmoid_norm")
REFERENCE_FREE = ("simpo", "cpo", "orpo")   # need no reference model
_log_sigmoid = jax.nn.log_sigmoid


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, *, beta: float,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, chosen_lengths=None, rejected_lengths=None,
             discopop_tau: float = 0.05):
  """(losses [B], chosen_rewards [B], rejected_rewards [B]); rewards are beta * (logp - ref_logp)."""
  chosen_lr = chosen_logps - ref_chosen_logps
  rejected_lr = rejected_logps - ref_rejected_logps
  delta = chosen_lr - rejected_lr
  eps = label_smoothing
  if loss_type == "sigmoid":  # DPO (Rafailov et al. 2023); eps > 0 is conservative DPO (Mitchell 2023)
    losses = -(1 - eps) * _log_sigmoid(beta * delta) - eps * _log_sigmoid(-beta * delta)
  elif loss_type == "hinge":  # SLiC (Zhao et al. 2023)
    losses = jax.nn.relu(1 - beta * delta)
  elif loss_type in ("ipo", "sigmoid_norm"):
    if chosen_lengths is None or rejected_lengths is None:
      raise ValueError(f"loss_type {loss_type!r} averages over tokens: pass chosen_lengths and rejected_lengths")
    avg = chosen_lr / jnp.maximum(chosen_lengths, 1) - rejected_lr / jnp.maximum(rejected_lengths, 1)
    # IPO (Azar et al. 2023, eq. 17) on per-token log-ratios, as TRL normalises it.
    losses = (avg - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -_log_sigmoid(beta * avg)
  elif loss_type == "exo_pair":  # EXO (Ji et al. 2024, eq. 16); needs 0 < label_smoothing < 1
    if not 0 < eps < 1:
      raise ValueError("exo_pair needs 0 < label_smoothing < 1 (TRL suggests 1e-3)")
    qw, ql = jax.nn.sigmoid(beta * delta), jax.nn.sigmoid(-beta * delta)
    losses = qw * (_log_sigmoid(beta * delta) - jnp.log1p(-eps)) + ql * (_log_sigmoid(-beta * delta) - jnp.log(eps))
  elif loss_type == "nca_pair":  # NCA (Chen et al. 2024)
    rc, rr = beta * chosen_lr, beta * rejected_lr
    losses = -_log_sigmoid(rc) - 0.5 * _log_sigmoid(-rc) - 0.5 * _log_sigmoid(-rr)
  elif loss_type == "robust":  # rDPO (Chowdhury et al. 2024)
    losses = (-(1 - eps) * _log_sigmoid(beta * delta) + eps * _log_sigmoid(-beta * delta)) / (1 - 2 * eps)
  elif loss_type == "bco_pair":  # BCO on pairs, without the running reward shift
    losses = -_log_sigmoid(beta * chosen_lr) - _log_sigmoid(-beta * rejected_lr)
  elif loss_type == "sppo_hard":  # SPPO (Wu et al. 2024) with hard 0/1 win probabilities
    losses = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
  elif loss_type == "apo_zero":  # APO (D'Oosterlinck et al. 2024, eq. 7)
    losses = 1 - jax.nn.sigmoid(beta * chosen_lr) + jax.nn.sigmoid(beta * rejected_lr)
  elif loss_type == "apo_down":  # APO eq. 8
    losses = jax.nn.sigmoid(beta * chosen_lr) + 1 - jax.nn.sigmoid(beta * delta)
  elif loss_type == "discopop":  # DiscoPOP (Chan et al. 2024, eq. 5)
    logits = beta * delta
    mix = jax.nn.sigmoid(logits / discopop_tau)
    losses = -_log_sigmoid(logits) * (1 - mix) + jnp.exp(-logits) * mix
  else:
    raise ValueError(f"DPO loss_type {loss_type!r}; accepted: {', '.join(PAIRED)}")
  return losses, jax.lax.stop_gradient(beta * chosen_lr), jax.lax.stop_gradient(beta * rejected_lr)


def simpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, *, beta: float = 2.0,
               gamma: float = 0.5, label_smoothing: float = 0.0):
  """SimPO (Meng et al. 2024): reference-free, length-normalised, with target margin gamma (TRL's CPOTrainer:
  logits = avg_c - avg_r - gamma / beta)."""
  logits = (chosen_logps / jnp.maximum(chosen_lengths, 1) - rejected_logps / jnp.maximum(rejected_lengths, 1)
            - gamma / beta)
  losses = -(1 - label_smoothing) * _log_sigmoid(beta * logits) - label_smoothing * _log_sigmoid(-beta * logits)
  return losses, beta * chosen_logps / jnp.maximum(chosen_lengths, 1), beta * rejected_logps / jnp.maximum(
      rejected_lengths, 1)


def cpo_loss(chosen_logps, rejected_logps, chosen_nll, *, beta: float = 0.1, alpha: float = 1.0,
             label_smoothing: float = 0.0):
  """CPO (Xu et al. 2024): reference-free sigmoid preference loss plus alpha x NLL of the chosen response."""
  logits = chosen_logps - rejected_logps
  losses = -(1 - label_smoothing) * _log_sigmoid(beta * logits) - label_smoothing * _log_sigmoid(-beta * logits)
  return losses + alpha * chosen_nll, beta * chosen_logps, beta * rejected_logps


def orpo_loss(chosen_logps, rejected_logps, chosen_lengths, rejected_lengths, chosen_nll, *, lam: float = 0.1):
  """ORPO (Hong et al. 2024): NLL of the chosen minus lambda x log sigmoid(log odds ratio), on per-token average
  log-probs (TRL's ORPOTrainer). Returns (losses, log_odds_ratio)."""
  c = chosen_logps / jnp.maximum(chosen_lengths, 1)
  r = rejected_logps / jnp.maximum(rejected_lengths, 1)
  log_odds = (c - r) - (jnp.log1p(-jnp.exp(c)) - jnp.log1p(-jnp.exp(r)))
  return chosen_nll - lam * _log_sigmoid(log_odds), log_odds


def kto_loss(logps, ref_logps, desirable, kl_logps, kl_ref_logps, *, beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
  """KTO (Ethayarajh et al. 2024) on unpaired examples [B] with a boolean `desirable` label. The reference point is
  the batch KL estimate mean(kl_logps - kl_ref_logps) over mismatched (prompt, completion) pairs, clamped at 0 and
  held constant (TRL's KTOTrainer)."""
  kl = jax.lax.stop_gradient(jnp.maximum(jnp.mean(kl_logps - kl_ref_logps), 0.0))
  logratio = logps - ref_logps
  losses = jnp.where(desirable, desirable_weight * (1 - jax.nn.sigmoid(beta * (logratio - kl))),
                     undesirable_weight * (1 - jax.nn.sigmoid(beta * (kl - logratio))))
  return losses, jax.lax.stop_gradient(beta * logratio), kl
