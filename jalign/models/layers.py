"""The decoder's weights: every block's parameters stacked on a leading `layers` axis (over the layers that hold
each one, `ModelConfig.stacked_layers`), with the logical axes the sharding rules read."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jalign.models.config import ModelConfig
from jalign.models.sharding import AXES


def param(rngs: nnx.Rngs | None, shape, axes, dtype, init: str = "normal") -> nnx.Param:
  if init == "normal":  # HF initializer_range default
    value = 0.02 * jax.random.normal(rngs.params(), shape, jnp.float32)
  elif init == "ones":
    value = jnp.ones(shape, jnp.float32)
  else:
    value = jnp.zeros(shape, jnp.float32)
  return nnx.Param(value.astype(dtype), **{AXES: axes})


class Layers(nnx.Module):
  """All decoder blocks' weights, stacked [L, ...]."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    D, F, N, K, H = cfg.hidden_size, cfg.mlp_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.param_dtype
    norm_init = "zeros" if cfg.norm_offset else "ones"

    def p(shape, axes, init="normal"):  # stacked over the layers that hold it (`ModelConfig.stacked_layers`)
      return param(rngs, shape, axes, pd, init)

    L, Ld, Lm = cfg.num_layers, len(cfg.stacked_layers("gate")), len(cfg.moe_layers)
    self.attn_norm = p((L, D), ("layers", "norm"), norm_init)
    if cfg.q_lora_rank:  # MLA's query bottleneck
      self.q_a = p((L, D, cfg.q_lora_rank), ("layers", "embed", "latent"))
      self.q_a_norm = p((L, cfg.q_lora_rank), ("layers", "norm"), norm_init)
      self.q_b = p((L, cfg.q_lora_rank, N, H), ("layers", "latent", "heads", "head_dim"))
    else:
      self.q = p((L, D, N, H), ("layers", "embed", "heads", "head_dim"))
    if cfg.kv_lora_rank:  # MLA: the latent and the shared RoPE key, then the latent's per-head keys (no RoPE) + values
      R = cfg.kv_lora_rank
      self.kv_a = p((L, D, R + cfg.qk_rope_head_dim), ("layers", "embed", "latent"))
      self.kv_a_norm = p((L, R), ("layers", "norm"), norm_init)
      self.kv_b = p((L, R, N, H - cfg.qk_rope_head_dim + cfg.v_dim), ("layers", "latent", "heads", "head_dim"))
    else:
      self.k = p((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
      self.v = p((L, D, K, H), ("layers", "embed", "kv_heads", "head_dim"))
    self.o = p((L, N, cfg.v_dim, D), ("layers", "heads", "head_dim", "embed"))
    if cfg.qkv_bias:
      self.q_bias = p((L, N, H), ("layers", "heads", "head_dim"), "zeros")
      self.k_bias = p((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
      self.v_bias = p((L, K, H), ("layers", "kv_heads", "head_dim"), "zeros")
    if cfg.out_bias:
      self.o_bias = p((L, D), ("layers", "norm"), "zeros")
    if cfg.qk_norm:
      self.q_norm = p((L, H), ("layers", "norm"), norm_init)
      self.k_norm = p((L, H), ("layers", "norm"), norm_init)
    if cfg.attn_sinks:
      self.sinks = p((L, N), ("layers", "heads"), "zeros")
    if cfg.post_norms:
      self.post_attn_norm = p((L, D), ("layers", "norm"), norm_init)
      self.post_ffw_norm = p((L, D), ("layers", "norm"), norm_init)
    self.ffw_norm = p((L, D), ("layers", "norm"), norm_init)
    if F:  # the dense MLP (an MoE model's dense layers')
      self.gate = p((Ld, D, F), ("layers", "embed", "mlp"))
      self.up = p((Ld, D, F), ("layers", "embed", "mlp"))
      self.down = p((Ld, F, D), ("layers", "mlp", "embed"))
    if cfg.shared_expert_size:  # a dense MLP beside the routed experts
      Fs = cfg.shared_expert_size
      self.shared_gate = p((Lm, D, Fs), ("layers", "embed", "mlp"))
      self.shared_up = p((Lm, D, Fs), ("layers", "embed", "mlp"))
      self.shared_down = p((Lm, Fs, D), ("layers", "mlp", "embed"))
    if cfg.num_experts:
      E, Fe = cfg.num_experts, cfg.moe_intermediate_size
      self.router = p((Lm, D, E), ("layers", "embed", "router"))
      self.expert_gate = p((Lm, E, D, Fe), ("layers", "experts", "embed", "expert_mlp"))
      self.expert_up = p((Lm, E, D, Fe), ("layers", "experts", "embed", "expert_mlp"))
      self.expert_down = p((Lm, E, Fe, D), ("layers", "experts", "expert_mlp", "embed"))
    if cfg.router_bias:
      self.router_bias = p((Lm, cfg.num_experts), ("layers", "router"), "zeros")
    if cfg.router_score == "sigmoid" and cfg.num_experts:  # DeepSeek-V3's selection-only bias (never trained)
      self.router_correction_bias = p((Lm, cfg.num_experts), ("layers", "router"), "zeros")
    if cfg.expert_bias:
      E, Fe = cfg.num_experts, cfg.moe_intermediate_size
      self.expert_gate_bias = p((Lm, E, Fe), ("layers", "experts", "expert_mlp"), "zeros")
      self.expert_up_bias = p((Lm, E, Fe), ("layers", "experts", "expert_mlp"), "zeros")
      self.expert_down_bias = p((Lm, E, D), ("layers", "experts", "norm"), "zeros")
    if cfg.shared_expert_gate:
      self.shared_expert_gate = p((Lm, D), ("layers", "embed"))
    if cfg.mlp_bias:
      self.gate_bias = p((Ld, F), ("layers", "mlp"), "zeros")
      self.up_bias = p((Ld, F), ("layers", "mlp"), "zeros")
      self.down_bias = p((Ld, D), ("layers", "norm"), "zeros")

  def arrays(self) -> dict[str, jax.Array]:
    return {name: v[...] for name, v in vars(self).items() if isinstance(v, nnx.Param)}
