"""Sparse upcycling (Komatsuzaki et al. 2022): an MoE decoder started from a dense one, every expert a copy of the
dense MLP and a new router. With renormalised top-k gates the copies compute the dense model's function exactly;
`noise` perturbs each copy so the experts (and so the routing) start to differ."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.core.errors import ConfigError
from jalign.models.decoder import Decoder, create

# dense family -> the MoE family with the same attention and norms (exportable both ways)
UPCYCLED = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}


def upcycle(lm: Decoder, *, num_experts: int, experts_per_token: int, noise: float = 0.0, seed: int = 0) -> Decoder:
  """`lm` (dense, fp32 weights) as an MoE decoder of `num_experts` copies of its MLP, `experts_per_token` of them
  per token with renormalised gates; each copy's weights times (1 + noise x N(0, 1)); the router drawn as
  `create` draws it (seed `seed`)."""
  cfg = lm.cfg
  if cfg.num_experts:
    raise ConfigError(f"upcycle: the model ({cfg.model_type}) already has {cfg.num_experts} experts")
  if cfg.model_type not in UPCYCLED or cfg.mlp_bias:
    raise ConfigError(f"upcycle: model_type {cfg.model_type!r}{' with MLP biases' if cfg.mlp_bias else ''}; "
                      f"accepted: {', '.join(UPCYCLED)} (without MLP biases)")
  moe_cfg = dataclasses.replace(cfg, model_type=UPCYCLED[cfg.model_type], num_experts=num_experts,
                                experts_per_token=experts_per_token, moe_intermediate_size=cfg.intermediate_size,
                                norm_topk_prob=True)
  graphdef, state = nnx.split(create(moe_cfg, seed=seed))
  params, dense = nnx.to_pure_dict(state), nnx.to_pure_dict(nnx.state(lm))
  for name, value in dense.items():
    if name != "layers":
      params[name] = value
  keys = jax.random.split(jax.random.key(seed), 3)
  for key, (expert, mlp) in zip(keys, (("expert_gate", "gate"), ("expert_up", "up"), ("expert_down", "down"))):
    for name, value in dense["layers"].items():
      if name not in ("gate", "up", "down"):
        params["layers"][name] = value
    w_LxAxB = jnp.asarray(dense["layers"][mlp], jnp.float32)
    eps = jax.random.normal(key, (w_LxAxB.shape[0], num_experts) + w_LxAxB.shape[1:], jnp.float32)
    params["layers"][expert] = (w_LxAxB[:, None] * (1.0 + noise * eps)).astype(params["layers"][expert].dtype)
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)
