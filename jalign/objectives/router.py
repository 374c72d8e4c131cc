"""MoE router terms: the load-balancing auxiliary loss, the router z-loss, and the routing metrics, from the
`Routing` a forward pass returns (stacked over layers, sums over real tokens).

Load balancing as transformers 5 defines it for Qwen2/3-MoE and Mixtral (`load_balancing_loss_func`, Switch
Transformer eqs. 4-6, Fedus et al. 2021): over all layers' tokens, f_e = the fraction of top-k choices that went to
expert e (summing to k), P_e = the mean router probability of e; loss = E * sum_e f_e P_e (k for a uniform
router). The z-loss is ST-MoE's
(Zoph et al. 2022, eq. 5): the mean over tokens and layers of logsumexp(router logits)^2.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jalign.core.errors import ConfigError
from jalign.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RouterLoss:
  """The router terms' coefficients as configured (`model.router_aux_loss`, `model.router_z_loss`)."""
  aux: float | None = 0.0   # load balancing; None = the checkpoint's (`coefficients`)
  z: float = 0.0            # z-loss
  rl: bool = False          # an RL objective: `aux` None means 0


def coefficients(model_cfg: ModelConfig, setting: RouterLoss) -> tuple[float, float]:
  """(aux, z) a run trains `model_cfg` with: `aux` None takes the checkpoint's (`router_aux_loss_coef` when its
  `output_router_logits` is true, as transformers adds it) for SFT-like objectives and 0 for RL."""
  aux, z = setting.aux, setting.z
  if not model_cfg.num_experts and (aux or z):
    raise ConfigError(f"config.model.router_aux_loss={aux}, router_z_loss={z}: the model "
                      f"({model_cfg.model_type}) has no experts; these apply to MoE models only")
  if aux is None:
    aux = 0.0 if setting.rl or not model_cfg.output_router_logits else model_cfg.router_aux_loss_coef
  return float(aux), float(z)


def terms(routing, model_cfg: ModelConfig, setting: RouterLoss) -> tuple[jnp.ndarray, dict]:
  """(the penalty to add to the mean loss, metrics) from a stacked `Routing` (L layers)."""
  aux_coef, z_coef = coefficients(model_cfg, setting)
  E, k = model_cfg.num_experts, model_cfg.experts_per_token
  tokens = jnp.maximum(jnp.sum(routing.tokens), 1.0)
  f_E = jnp.sum(routing.counts_E, axis=0) / tokens
  p_E = jnp.sum(routing.probs_E, axis=0) / tokens
  aux = E * jnp.sum(f_E * p_E)
  z = jnp.sum(routing.z_sum) / tokens
  layer_tokens_L = jnp.maximum(routing.tokens, 1.0)
  # Busiest expert's load over the mean load (k * tokens / E), per layer, averaged over layers: 1 = balanced.
  load_max = jnp.mean(jnp.max(routing.counts_E, axis=-1) * E / (k * layer_tokens_L))
  metrics = {"moe/aux_loss": aux, "moe/z_loss": z, "moe/expert_load_max": load_max,
             "moe/router_entropy": jnp.sum(routing.entropy_sum) / tokens,
             "moe/routing_mismatch": jnp.sum(routing.mismatch_sum) / (k * jnp.maximum(jnp.sum(routing.recorded), 1.0)),
             "moe/dropped_tokens": jnp.sum(routing.dropped) / (k * tokens)}
  return aux_coef * aux + z_coef * z, metrics
