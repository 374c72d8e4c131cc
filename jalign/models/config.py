"""Typed decoder config (its Hugging Face `config.json` form: `models.hf_config`).

One `ModelConfig` covers every supported family; the family's quirks are plain fields (norm offset, post norms,
soft-caps, q/k norms, per-layer windows and RoPE), so the decoder has a single code path.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal

import numpy as np

from jalign.core.errors import ConfigError
from jalign.kernels.attn import IMPLS as ATTENTION_IMPLS
from jalign.models.lora import LoraConfig

MOE_IMPLS = ("auto", "xla", "ragged", "megablox")  # `kernels.moe.grouped_matmul`
# `Layers` parameters stacked over the MoE layers only, and over the dense-MLP ones when an MoE model has both.
_ROUTED = ("router", "expert_gate", "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down",
           "shared_expert_gate", "router_bias", "router_correction_bias", "expert_gate_bias", "expert_up_bias",
           "expert_down_bias")
ROUTER_SCORES = ("softmax", "sigmoid")
_DENSE_MLP = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10_000.0
  kind: str = "default"           # default | linear | llama3 | yarn
  factor: float = 1.0
  low_freq_factor: float = 1.0    # llama3 only
  high_freq_factor: float = 4.0   # llama3 only
  original_max_position_embeddings: int = 8192  # llama3 and yarn
  beta_fast: float = 32.0         # yarn only: the ramp between interpolated and extrapolated frequencies
  beta_slow: float = 1.0          # yarn only
  truncate: bool = True           # yarn only: the ramp's ends rounded to whole dimensions
  attention_factor: float | None = None  # yarn only: cos / sin scale; None = 0.1 ln(factor) + 1 (YaRN eq. 21)
  # DeepSeek (MLA): the softmax scale times mscale(factor, mscale_all_dim)^2 as well (transformers
  # `yarn_apply_mscale`, after DeepSeek-V2's reference); 0 = not
  mscale_all_dim: float = 0.0

  def to_hf(self) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": self.kind, "rope_theta": self.theta}
    if self.kind in ("linear", "llama3", "yarn"):
      out["factor"] = self.factor
    if self.kind == "llama3":
      out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                 original_max_position_embeddings=self.original_max_position_embeddings)
    if self.kind == "yarn":
      out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow, truncate=self.truncate,
                 original_max_position_embeddings=self.original_max_position_embeddings)
      if self.attention_factor is not None:
        out["attention_factor"] = self.attention_factor
    if self.mscale_all_dim:
      out["mscale_all_dim"] = self.mscale_all_dim
    return out

  @property
  def scale(self) -> float:
    """The factor on cos and sin (and so on q and k): YaRN's attention factor, else 1."""
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor is not None:
      return self.attention_factor
    return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

  @property
  def softmax_scale(self) -> float:
    """The factor on an MLA model's softmax scale: mscale(factor, mscale_all_dim)^2, else 1."""
    if self.kind == "default" or not self.mscale_all_dim or self.factor <= 1:
      return 1.0
    return (0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0) ** 2


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Static description of a decoder. Hashable, so jitted code can close over it."""
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  model_type: str = "llama"
  max_position_embeddings: int = 2048
  rms_norm_eps: float = 1e-6
  activation: str = "silu"                 # silu | gelu_tanh | gelu
  qkv_bias: bool = False                   # Qwen2 (and Llama attention_bias)
  out_bias: bool = False                   # Llama attention_bias also biases o_proj
  mlp_bias: bool = False
  qk_norm: bool = False                    # Qwen3, Gemma 3
  norm_offset: float = 0.0                 # Gemma stores w and scales by (1 + w)
  post_norms: bool = False                 # Gemma 2/3: norms after attention and after the MLP too
  embed_scale: bool = False                # Gemma: embeddings times sqrt(hidden)
  tie_embeddings: bool = False
  query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by this**-0.5 instead of head_dim**-0.5
  attn_softcap: float | None = None        # Gemma 2
  final_softcap: float | None = None       # Gemma 2
  rope: RopeConfig = RopeConfig()          # global (full-attention) layers
  local_rope: RopeConfig | None = None     # sliding layers when they differ (Gemma 3)
  sliding_window: int | None = None
  layer_types: tuple[str, ...] = ()        # per layer "full_attention" | "sliding_attention"; () = all full
  # Mixture of Experts: each token's MLP is the gate-weighted sum of its top-k experts.
  num_experts: int = 0                     # routed experts per layer; 0 = a dense MLP
  mlp_only_layers: tuple[int, ...] = ()    # an MoE model's layers whose MLP is dense (intermediate_size) instead
  experts_per_token: int = 0               # k
  moe_intermediate_size: int = 0           # each expert's hidden size
  norm_topk_prob: bool = False             # renormalise the k gate values to sum to 1 (Mixtral always does)
  shared_expert_size: int = 0              # a dense MLP beside the experts (`shared_gate/up/down`); 0 = none
  shared_expert_gate: bool = False         # Qwen2-MoE: the shared expert's output scaled by sigmoid(h . w)
  # DeepSeek-V3: sigmoid scores, chosen by score + `router_correction_bias` (selection only, not trained) among the
  # `groups_per_token` best of `expert_groups` groups (a group ranked by its two best), gates times a factor.
  router_score: str = "softmax"            # softmax | sigmoid
  expert_groups: int = 1
  groups_per_token: int = 1
  routed_scaling_factor: float = 1.0
  # Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434): keys and values from one compressed latent of
  # `kv_lora_rank` per token plus a shared RoPE key of `qk_rope_head_dim`; queries through a `q_lora_rank`
  # bottleneck (0 = one projection). head_dim = no-RoPE + RoPE dims of a query/key head. 0 = standard attention.
  kv_lora_rank: int = 0
  q_lora_rank: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  rope_interleave: bool = False            # RoPE over interleaved pairs (x0, x1), (x2, x3)... (DeepSeek's layout)
  router_aux_loss_coef: float = 0.0        # the checkpoint's load-balancing coefficient (HF config), and whether
  output_router_logits: bool = False       # transformers would train with it (`objectives.router.coefficients`)
  # gpt-oss: a learned logit per head in each attention softmax's denominator ("sinks"), a router bias, biased
  # experts, and a clamped SwiGLU in the experts (`models.moe.glu`).
  attn_sinks: bool = False
  router_bias: bool = False
  expert_bias: bool = False
  swiglu_limit: float | None = None
  swiglu_alpha: float = 1.702
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # Runtime knobs (not part of the checkpoint).
  param_dtype: str = "float32"
  dtype: str = "float32"                   # activation / compute dtype
  scan_layers: bool = True                 # lax.scan over layers: compile time flat in depth
  remat: str = "none"                      # none | full | dots (save matmul outputs, recompute the rest)
  attention: str = "auto"                  # `kernels.attention` impl for training and scoring forwards
  moe_impl: str = "auto"                   # `kernels.moe.grouped_matmul` impl for the experts
  moe_capacity_factor: float = 0.0         # > 0: each expert takes at most this x its even share of a forward's
                                           # choices (`models.moe.capacity_keep`); 0 = dropless

  def __post_init__(self):
    if self.layer_types and len(self.layer_types) != self.num_layers:
      raise ConfigError(f"layer_types has {len(self.layer_types)} entries, num_layers is {self.num_layers}")
    for t in self.layer_types:
      if t not in ("full_attention", "sliding_attention"):
        raise ConfigError(f"layer_types entry {t!r}; accepted: 'full_attention', 'sliding_attention'")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(f"num_attention_heads={self.num_heads} is not a multiple of "
                        f"num_key_value_heads={self.num_kv_heads}")
    if self.activation not in ("silu", "gelu_tanh", "gelu"):
      raise ConfigError(f"activation {self.activation!r}; accepted: silu, gelu_tanh, gelu")
    if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
      raise ConfigError(f"num_experts_per_tok={self.experts_per_token}: must be in [1, num_experts={self.num_experts}]")
    if self.local_rope is not None and self.local_rope.scale != self.rope.scale:
      raise ConfigError(f"sliding layers' rope scale {self.local_rope.scale} differs from the full layers' "
                        f"{self.rope.scale}: one attention factor per model is supported")
    if self.mlp_only_layers:
      if list(self.mlp_only_layers) != sorted(set(self.mlp_only_layers)) or not all(
          0 <= i < self.num_layers for i in self.mlp_only_layers):
        raise ConfigError(f"mlp_only_layers={list(self.mlp_only_layers)}: must be distinct, ascending layer indices "
                          f"in [0, {self.num_layers})")
      if len(self.mlp_only_layers) == self.num_layers:
        raise ConfigError(f"mlp_only_layers names all {self.num_layers} layers: no layer is MoE (num_experts=0 for "
                          "a dense model)")
      if not self.num_experts:
        raise ConfigError(f"mlp_only_layers={list(self.mlp_only_layers)}: dense layers are set in an MoE model "
                          "(num_experts > 0)")
    if self.num_experts and self.moe_intermediate_size <= 0:
      raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size}: must be > 0 for an MoE model")
    if self.router_score not in ROUTER_SCORES:
      raise ConfigError(f"router_score {self.router_score!r}; accepted: {', '.join(ROUTER_SCORES)}")
    E, G = self.num_experts, self.expert_groups
    if E and (E % G or not 0 < self.groups_per_token <= G or (G > 1 and E // G < 2)
              or self.experts_per_token > self.groups_per_token * E // G):
      raise ConfigError(f"n_group={self.expert_groups}, topk_group={self.groups_per_token}: groups must split "
                        f"num_experts={self.num_experts} evenly into groups of 2 or more, 1 <= topk_group <= n_group, "
                        f"and the kept groups hold at least num_experts_per_tok={self.experts_per_token} experts")
    if self.kv_lora_rank:
      if not 0 < self.qk_rope_head_dim < self.head_dim or self.qk_rope_head_dim % 2 or self.v_head_dim <= 0:
        raise ConfigError(f"multi-head latent attention: qk_rope_head_dim={self.qk_rope_head_dim} must be even and "
                          f"below head_dim={self.head_dim} (qk_nope_head_dim + qk_rope_head_dim), v_head_dim="
                          f"{self.v_head_dim} > 0")
      if self.num_kv_heads != self.num_heads or self.qkv_bias or self.out_bias or self.qk_norm or self.attn_sinks:
        raise ConfigError("multi-head latent attention has one key/value head per query head and no attention "
                          "biases, q/k norms or sinks")
    if self.moe_capacity_factor < 0:
      raise ConfigError(f"moe_capacity_factor={self.moe_capacity_factor}: must be >= 0 (0 = dropless)")
    if self.moe_impl not in MOE_IMPLS:
      raise ConfigError(f"moe_impl {self.moe_impl!r}; accepted: {', '.join(MOE_IMPLS)}")
    if self.attention not in ATTENTION_IMPLS:
      raise ConfigError(f"attention {self.attention!r}; accepted: {', '.join(ATTENTION_IMPLS)}")
    if self.remat not in ("none", "full", "dots"):
      raise ConfigError(f"remat {self.remat!r}; accepted: none, full, dots")
    for key in ("param_dtype", "dtype"):
      if getattr(self, key) not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{key}={getattr(self, key)!r}; accepted: float32, bfloat16, float16")

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @property
  def decode_attention(self) -> str:
    """`kernels.decode_attention`'s impl for decoding over a per-row cache: `xla` when `attention` is, else `auto`."""
    return "xla" if self.attention == "xla" else "auto"

  @property
  def mlp_size(self) -> int:
    """The dense MLP's hidden size: a dense model's, or an MoE model's `mlp_only_layers`' (0: it has none; a shared
    expert is `shared_expert_size`)."""
    if self.num_experts and not self.mlp_only_layers:
      return 0
    return self.intermediate_size

  @property
  def rope_dim(self) -> int:
    """The dims of a query / key head that RoPE rotates: all of them, or an MLA model's last `qk_rope_head_dim`."""
    return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

  @property
  def v_dim(self) -> int:
    """A value head's size (an MLA model's `v_head_dim`, else head_dim)."""
    return self.v_head_dim if self.kv_lora_rank else self.head_dim

  @property
  def cache_shape(self) -> tuple[int, int]:
    """(heads, head size) of the decoding cache: the key/value heads, or an MLA model's one compressed head, its
    latent and RoPE key ([c, k_rope]; its queries are absorbed into that space, `models.mla.qkv`)."""
    if self.kv_lora_rank:
      return 1, self.kv_lora_rank + self.qk_rope_head_dim
    return self.num_kv_heads, self.head_dim

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """The layers whose MLP is routed: an MoE model's all but `mlp_only_layers`, a dense model's none."""
    if not self.num_experts:
      return ()
    return tuple(i for i in range(self.num_layers) if i not in self.mlp_only_layers)

  def stacked_layers(self, name: str) -> tuple[int, ...]:
    """The layers whose weights the `Layers` parameter `name` stacks, in order (a LoRA adapter's: its
    projection's): the router and experts the MoE layers', a model with dense MLP layers beside them its MLP
    the dense layers', everything else every layer's."""
    base = name.split("_lora_")[0]
    if base in _ROUTED:
      return self.moe_layers
    if base in _DENSE_MLP and self.mlp_only_layers:
      return self.mlp_only_layers
    return tuple(range(self.num_layers))

  def layer_runs(self) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive layers that hold the same parameters (one run unless dense and MoE
    layers mix): each runs as one scan."""
    sparse = [i in self.moe_layers for i in range(self.num_layers)]
    starts = [i for i in range(self.num_layers) if i == 0 or sparse[i] != sparse[i - 1]]
    return list(zip(starts, starts[1:] + [self.num_layers]))

  @property
  def scale(self) -> float:
    base = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
    return base * self.rope.softmax_scale if self.kv_lora_rank else base

  def layer_windows(self) -> np.ndarray:
    """Per-layer attention window (0 = unlimited) as an int32 array [L]."""
    types = self.layer_types or ("full_attention",) * self.num_layers
    w = self.sliding_window or 0
    return np.array([w if t == "sliding_attention" else 0 for t in types], np.int32)

  def layer_inv_freq(self) -> np.ndarray:
    """Per-layer RoPE inverse frequencies, float32 [L, rope_dim // 2]."""
    types = self.layer_types or ("full_attention",) * self.num_layers
    local = self.local_rope or self.rope
    per_type = {"full_attention": rope_inv_freq(self.rope, self.rope_dim),
                "sliding_attention": rope_inv_freq(local, self.rope_dim)}
    return np.stack([per_type[t] for t in types])

  def num_params(self, active: bool = False) -> int:
    """Parameters in all; `active`: those one token uses (an MoE model's k experts of E)."""
    d, f, h, k, hd = self.hidden_size, self.mlp_size, self.num_heads, self.num_kv_heads, self.head_dim
    experts = self.experts_per_token if active else self.num_experts
    per_layer = (d * hd * (2 * h + 2 * k) + 2 * d + (hd * (h + 2 * k) if self.qkv_bias else 0)
                 + (d if self.out_bias else 0) + (2 * hd if self.qk_norm else 0) + (2 * d if self.post_norms else 0))
    if self.kv_lora_rank:  # the router's correction bias is a buffer in transformers: not counted
      rq, rkv = self.q_lora_rank, self.kv_lora_rank
      q = d * rq + rq + rq * h * hd if rq else d * h * hd
      per_layer = (q + d * (rkv + self.qk_rope_head_dim) + rkv + rkv * h * (hd - self.qk_rope_head_dim + self.v_dim)
                   + h * self.v_dim * d + 2 * d)
    per_mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
    fe = self.moe_intermediate_size
    per_moe = (d * self.num_experts + 3 * d * fe * experts + (d if self.shared_expert_gate else 0)
               + 3 * d * self.shared_expert_size
               + (self.num_experts if self.router_bias else 0) + ((2 * fe + d) * experts if self.expert_bias else 0))
    per_layer += h if self.attn_sinks else 0
    return (self.num_layers * per_layer + len(self.stacked_layers("gate")) * per_mlp
            + len(self.moe_layers) * per_moe + self.vocab_size * d * (1 if self.tie_embeddings else 2) + d)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """Inverse frequencies as transformers' ROPE_INIT_FUNCTIONS compute them (default, linear, llama3, yarn)."""
  inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  inv = inv.astype(np.float32)
  if rope.kind == "yarn":
    # YaRN (Peng et al. 2023, arXiv:2309.00071): frequencies that turn fewer than beta_slow times over the original
    # context are interpolated by `factor`, those that turn more than beta_fast times kept, a linear ramp between.
    def dim_of(rotations):
      return head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
          2 * math.log(rope.theta))
    low, high = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp  # the extrapolated (unscaled) share
    return ((inv / rope.factor) * (1 - keep) + inv * keep).astype(np.float32)
  if rope.kind == "linear":
    return (inv / rope.factor).astype(np.float32)
  if rope.kind == "llama3":
    # Llama 3.1 frequency-dependent scaling (Meta's reference; transformers `_compute_llama3_parameters`).
    old = rope.original_max_position_embeddings
    low_wl, high_wl = old / rope.low_freq_factor, old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wl, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str = ""                       # HF checkpoint directory; "" = initialise `arch` from scratch
  arch: ModelConfig | None = None      # architecture for a from-scratch model
  dtype: Literal["float32", "bfloat16"] = "float32"           # parameters
  compute_dtype: Literal["", "float32", "bfloat16"] = ""       # activations; "" = dtype
  scan_layers: bool = True                # run the layers as one scanned block (one compile for all of them)
  # recompute activations in the backward: none, full, or dots (keep matmul outputs)
  remat: Literal["none", "full", "dots"] = "none"
  attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = "auto"  # `kernels.attention` impl
  # MoE models: the experts' grouped matmul (`kernels.moe`)
  moe_impl: Literal["auto", "xla", "ragged", "megablox"] = "auto"
  # MoE models: > 0 caps each expert at this x its even share of a forward's token choices (GShard / Switch; first
  # choices before second ones, earlier tokens first), the rest dropped (moe/dropped_tokens); 0 = dropless
  moe_capacity_factor: float = 0.0
  # MoE models: the load-balancing loss coefficient; None = the checkpoint's (router_aux_loss_coef when its
  # output_router_logits is true, as transformers trains), and 0 for RL objectives
  router_aux_loss: float | None = None
  router_z_loss: float = 0.0           # MoE models: the router z-loss coefficient (ST-MoE)
  lora: LoraConfig = LoraConfig()      # low-rank adapters; rank 0 = full fine-tuning
  offload_reference: bool = False      # DPO / GRPO / PPO: keep the frozen reference in host memory, copied to the
                                       # device only for its forward passes

  def knobs(self) -> dict:
    """The runtime fields of `ModelConfig` this section sets on a loaded or created model."""
    return dict(scan_layers=self.scan_layers, remat=self.remat, attention=self.attention, moe_impl=self.moe_impl,
                moe_capacity_factor=float(self.moe_capacity_factor))
