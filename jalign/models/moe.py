"""Mixture-of-Experts blocks of the decoder: the routed experts' share of a layer's MLP (`kernels.moe` for the
compute), what the router did (`Routing`), and the MoE fields of a Hugging Face config.json."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jalign.core.errors import ConfigError
from jalign.kernels import moe


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Routing:
  """What an MoE layer's router did over a batch (stacked [L, ...] over layers by `Decoder.forward_routed`). Sums
  are over real tokens (segment id != 0), so padding never counts."""
  ids_BxTxK: jax.Array      # the experts each token used (the replayed ones when replaying)
  counts_E: jax.Array       # token choices per expert
  probs_E: jax.Array        # router probabilities summed over tokens, per expert
  z_sum: jax.Array          # sum of logsumexp(router logits)^2 (ST-MoE's z-loss, times the tokens)
  entropy_sum: jax.Array    # sum of the router distribution's entropy
  mismatch_sum: jax.Array   # recorded choices the router would not have made itself
  recorded: jax.Array       # real tokens with recorded choices (`route_ids` >= 0)
  dropped: jax.Array        # real tokens' choices over an expert's capacity (`capacity_keep`), dropped
  tokens: jax.Array         # real tokens


def experts(cfg, h_BxTxD, lp: dict[str, jax.Array], real_BxT, recorded_BxTxK, activation: Callable, *,
            replay: bool = True, adapters: tuple | None = None, adapter_scale: float = 1.0,
            adapter_dropout: tuple | None = None):
  """The routed experts' share of the MLP (`cfg`: the decoder's ModelConfig), each token's top-k experts weighted
  by their gate values, and the layer's `Routing`. The router runs in fp32 whatever the compute dtype, so which
  experts a token picks does not hinge on bf16 rounding.

  `recorded_BxTxK`: choices made elsewhere (the sampler's; -1 on a token = none recorded), compared with the
  router's own (`Routing.mismatch_sum`) and, with `replay`, used instead of them: their gate values are still the
  router's own probabilities at those experts, so the router trains through them. `adapters`: the experts' LoRA
  adapters (`lora.expert_adapters`), added times `adapter_scale`, their inputs dropped out by `adapter_dropout`
  ((rate, key), training only)."""
  B, T, D = h_BxTxD.shape
  dt = h_BxTxD.dtype
  k = cfg.experts_per_token
  h_NxD = h_BxTxD.reshape(B * T, D)
  logits_NxE = h_NxD.astype(jnp.float32) @ lp["router"].astype(jnp.float32)
  if "router_bias" in lp:  # gpt-oss
    logits_NxE = logits_NxE + lp["router_bias"].astype(jnp.float32)
  router = dict(normalize=cfg.norm_topk_prob, score=cfg.router_score, factor=cfg.routed_scaling_factor)
  weights_NxK, own_NxK = moe.route(logits_NxE, k, bias_E=lp.get("router_correction_bias"), groups=cfg.expert_groups,
                                   groups_kept=cfg.groups_per_token, **router)
  ids_NxK = own_NxK
  real_N = real_BxT.reshape(-1).astype(jnp.float32)
  recorded_N = jnp.zeros_like(real_N)
  missed_N = jnp.zeros_like(real_N)
  if recorded_BxTxK is not None:
    rec_NxK = recorded_BxTxK.reshape(B * T, k).astype(jnp.int32)
    has_N = rec_NxK[:, 0] >= 0
    recorded_N = real_N * has_N
    missed_N = k - jnp.sum(jnp.any(own_NxK[:, :, None] == rec_NxK[:, None, :], axis=1), axis=-1)
    missed_N = jnp.where(has_N, missed_N, 0).astype(jnp.float32)
    if replay:
      rec_NxK = jnp.where(has_N[:, None], rec_NxK, own_NxK)
      weights_NxK = jnp.where(has_N[:, None], moe.replayed_weights(logits_NxE, rec_NxK, **router),
                              weights_NxK)
      ids_NxK = rec_NxK
  dropped = jnp.zeros(())
  if cfg.moe_capacity_factor and T > 1:  # decode steps (one token per row) route dropless
    keep_NxK = capacity_keep(ids_NxK, real_N, cfg.num_experts, cfg.moe_capacity_factor)
    weights_NxK = jnp.where(keep_NxK, weights_NxK, 0.0)
    dropped = jnp.sum(real_N[:, None] * ~keep_NxK)
  biases = None
  if "expert_gate_bias" in lp:  # gpt-oss
    biases = tuple(lp[f"expert_{n}_bias"].astype(dt) for n in ("gate", "up", "down"))
  out = moe.experts_mlp(h_NxD, ids_NxK, weights_NxK.astype(dt), lp["expert_gate"].astype(dt),
                        lp["expert_up"].astype(dt), lp["expert_down"].astype(dt), glu(cfg, activation),
                        impl=cfg.moe_impl, adapters=jax.tree.map(lambda a: a.astype(dt), adapters),
                        adapter_scale=adapter_scale, biases=biases, adapter_dropout=adapter_dropout)
  if cfg.router_score == "softmax":
    probs_NxE = jax.nn.softmax(logits_NxE, axis=-1)
  else:  # sigmoid scores normalised over the experts: DeepSeek-V3's balance-loss affinities (arXiv:2412.19437 eq. 19)
    scores_NxE = jax.nn.sigmoid(logits_NxE)
    probs_NxE = scores_NxE / jnp.sum(scores_NxE, axis=-1, keepdims=True)
  lse_N = jax.nn.logsumexp(logits_NxE, axis=-1)
  entropy_N = -jnp.sum(probs_NxE * jnp.log(jnp.maximum(probs_NxE, 1e-30)), axis=-1)
  chosen_NxE = jnp.sum(jax.nn.one_hot(ids_NxK, cfg.num_experts, dtype=jnp.float32), axis=1)
  routing = Routing(ids_NxK.reshape(B, T, k), real_N @ chosen_NxE, real_N @ probs_NxE, real_N @ lse_N ** 2,
                    real_N @ entropy_N, real_N @ missed_N, jnp.sum(recorded_N), dropped, jnp.sum(real_N))
  return out.reshape(B, T, D), routing


def glu(cfg, activation: Callable) -> Callable:
  """How an expert combines its gate and up projections: act(gate) * up, or gpt-oss's clamped SwiGLU (`swiglu_limit`
  set): gate clipped above and up on both sides at the limit, (up + 1) * gate * sigmoid(alpha * gate)."""
  if cfg.swiglu_limit is None:
    return moe.gated(activation)
  limit, alpha = cfg.swiglu_limit, cfg.swiglu_alpha

  def clamped(gate, up):
    gate = jnp.minimum(gate, limit)
    return (jnp.clip(up, -limit, limit) + 1) * (gate * jax.nn.sigmoid(gate * alpha))
  return clamped


def capacity_keep(ids_NxK, real_N, num_experts: int, factor: float):
  """[N, K] bool: which of the real tokens' choices fit their expert's capacity, ceil(factor x real tokens x K / E)
  choices each, taken as GShard and Switch Transformer take them (Lepikhin et al. 2020, Fedus et al. 2021): every
  token's first choice before any second one, earlier tokens first. A dropped choice adds nothing to its token (the
  residual carries it); the grouped matmul still computes its row."""
  N, K = ids_NxK.shape
  flat = ids_NxK.T.reshape(-1)  # choice-major: [K * N]
  valid = jnp.tile(real_N > 0, K)
  onehot = jax.nn.one_hot(flat, num_experts, dtype=jnp.int32) * valid[:, None].astype(jnp.int32)
  rank = jnp.take_along_axis(jnp.cumsum(onehot, axis=0), flat[:, None], axis=1)[:, 0] - 1
  capacity = jnp.ceil(factor * jnp.sum(real_N > 0) * K / num_experts)
  return (valid & (rank < capacity)).reshape(K, N).T


def stack(routings: list):
  """The MoE layers' `Routing`s as one, stacked [L, ...] (None for a dense model: none)."""
  return jax.tree.map(lambda *a: jnp.stack(a), *routings) if routings else None


def merge(prompts, responses, group_size: int):
  """One `Routing` of a grouped forward's two parts (`Decoder.response_routed`): the prompts' (one row per group)
  and the responses' on top of them; the sums added, the ids laid out per row (prompt ids repeated)."""
  if prompts is None:
    return None
  ids = jnp.concatenate([jnp.repeat(prompts.ids_BxTxK, group_size, axis=1), responses.ids_BxTxK], axis=2)
  sums = jax.tree.map(jnp.add, dataclasses.replace(prompts, ids_BxTxK=None),
                      dataclasses.replace(responses, ids_BxTxK=None))
  return dataclasses.replace(sums, ids_BxTxK=ids)


def moe_from_hf(hf: dict, model_type: str, n_layers: int, where: str) -> dict[str, Any]:
  """The MoE fields of `ModelConfig` from a Qwen2-MoE / Qwen3-MoE / Mixtral / gpt-oss / DeepSeek-V3 config.json ({}
  for dense families)."""
  if model_type == "deepseek_v3":
    return _deepseek_from_hf(hf, n_layers, where)
  if model_type not in ("qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"):
    return {}
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  if experts is None:
    raise ConfigError(f"{where}: missing required key 'num_experts' (or 'num_local_experts')")
  out = dict(num_experts=int(experts), experts_per_token=int(_need(hf, "num_experts_per_tok", where)))
  # transformers: layer i is sparse when it is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0
  step, only = int(hf.get("decoder_sparse_step", 1)), [int(i) for i in hf.get("mlp_only_layers") or []]
  if step < 1:
    raise ConfigError(f"{where}: decoder_sparse_step={step}: must be >= 1")
  dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
  if len(dense) == n_layers:
    raise ConfigError(f"{where}: decoder_sparse_step={step}, mlp_only_layers={only} leave no sparse layer in "
                      f"{n_layers}; load it as a dense model")
  out["mlp_only_layers"] = dense
  out.update(router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
             output_router_logits=bool(hf.get("output_router_logits", False)))
  if model_type == "mixtral":  # every expert is an MLP of intermediate_size; top-k always renormalised
    return {**out, "moe_intermediate_size": int(_need(hf, "intermediate_size", where)), "norm_topk_prob": True}
  if model_type == "gpt_oss":  # softmax over the top-k router logits (= renormalised); biased router and experts
    return {**out, "moe_intermediate_size": int(_need(hf, "intermediate_size", where)), "norm_topk_prob": True,
            "router_bias": True, "expert_bias": True, "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702))}
  out.update(moe_intermediate_size=int(_need(hf, "moe_intermediate_size", where)),
             norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
  if model_type == "qwen2_moe":
    out.update(shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0))
    out.update(shared_expert_gate=out["shared_expert_size"] > 0)
  return out


def _deepseek_from_hf(hf: dict, n_layers: int, where: str) -> dict[str, Any]:
  """DeepSeek-V3's routing (sigmoid scores, correction bias, groups, scaled gates), shared experts and first dense
  layers, as transformers' `DeepseekV3Config` reads them."""
  if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
    raise ConfigError(f"{where}: scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r}: "
                      "DeepSeek-V3 routing is scoring_func 'sigmoid' with topk_method 'noaux_tc'")
  first_dense = int(hf.get("first_k_dense_replace", 3))
  if not 0 <= first_dense < n_layers:
    raise ConfigError(f"{where}: first_k_dense_replace={first_dense}: must be in [0, num_hidden_layers={n_layers})")
  fe = int(_need(hf, "moe_intermediate_size", where))
  return dict(num_experts=int(hf.get("n_routed_experts", 256)), experts_per_token=int(hf.get("num_experts_per_tok", 8)),
              moe_intermediate_size=fe, shared_expert_size=fe * int(hf.get("n_shared_experts") or 0),
              mlp_only_layers=tuple(range(first_dense)), norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
              router_score="sigmoid", expert_groups=int(hf.get("n_group") or 1),
              groups_per_token=int(hf.get("topk_group") or 1),
              routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
              # transformers trains DeepSeek-V3 without a load-balancing loss (its balance is the correction bias)
              router_aux_loss_coef=0.0, output_router_logits=bool(hf.get("output_router_logits", False)))


def _need(hf: dict, key: str, where: str):
  if key not in hf:
    raise ConfigError(f"{where}: missing required key {key!r}")
  return hf[key]
