"""Typed decoder config, and its translation from / to a Hugging Face `config.json`.

One `ModelConfig` covers every supported family; the family's quirks are plain fields (norm offset, post norms,
soft-caps, q/k norms, per-layer windows and RoPE), so the decoder has a single code path.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Literal

import numpy as np

from jalign.core.errors import CheckpointError, ConfigError
from jalign.kernels.attn import IMPLS as ATTENTION_IMPLS
from jalign.models.lora import LoraConfig
from jalign.models.moe import moe_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "qwen2_moe",
                         "qwen3_moe", "mixtral")
MOE_IMPLS = ("auto", "xla", "ragged", "megablox")  # `kernels.moe.grouped_matmul`
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  theta: float = 10_000.0
  kind: str = "default"           # one of SUPPORTED_ROPE_TYPES
  factor: float = 1.0
  low_freq_factor: float = 1.0    # llama3 only
  high_freq_factor: float = 4.0   # llama3 only
  original_max_position_embeddings: int = 8192  # llama3 only

  def to_hf(self) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": self.kind, "rope_theta": self.theta}
    if self.kind in ("linear", "llama3"):
      out["factor"] = self.factor
    if self.kind == "llama3":
      out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                 original_max_position_embeddings=self.original_max_position_embeddings)
    return out


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
  # Mixture of Experts (every layer sparse): each token's MLP is the gate-weighted sum of its top-k experts.
  num_experts: int = 0                     # routed experts per layer; 0 = a dense MLP
  experts_per_token: int = 0               # k
  moe_intermediate_size: int = 0           # each expert's hidden size
  norm_topk_prob: bool = False             # renormalise the k gate values to sum to 1 (Mixtral always does)
  shared_expert_size: int = 0              # Qwen2-MoE: a dense MLP beside the experts (its `gate/up/down`); 0 = none
  shared_expert_gate: bool = False         # Qwen2-MoE: the shared expert's output scaled by sigmoid(h . w)
  router_aux_loss_coef: float = 0.0        # the checkpoint's load-balancing coefficient (HF config), and whether
  output_router_logits: bool = False       # transformers would train with it (`objectives.router.coefficients`)
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
    if self.num_experts and self.moe_intermediate_size <= 0:
      raise ConfigError(f"moe_intermediate_size={self.moe_intermediate_size}: must be > 0 for an MoE model")
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
    """The dense MLP's hidden size: the model's MLP, or an MoE model's shared expert (0: it has none)."""
    return self.shared_expert_size if self.num_experts else self.intermediate_size

  @property
  def scale(self) -> float:
    return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

  def layer_windows(self) -> np.ndarray:
    """Per-layer attention window (0 = unlimited) as an int32 array [L]."""
    types = self.layer_types or ("full_attention",) * self.num_layers
    w = self.sliding_window or 0
    return np.array([w if t == "sliding_attention" else 0 for t in types], np.int32)

  def layer_inv_freq(self) -> np.ndarray:
    """Per-layer RoPE inverse frequencies, float32 [L, head_dim // 2]."""
    types = self.layer_types or ("full_attention",) * self.num_layers
    local = self.local_rope or self.rope
    per_type = {"full_attention": rope_inv_freq(self.rope, self.head_dim),
                "sliding_attention": rope_inv_freq(local, self.head_dim)}
    return np.stack([per_type[t] for t in types])

  def num_params(self, active: bool = False) -> int:
    """Parameters in all; `active`: those one token uses (an MoE model's k experts of E)."""
    d, f, h, k, hd = self.hidden_size, self.mlp_size, self.num_heads, self.num_kv_heads, self.head_dim
    experts = self.experts_per_token if active else self.num_experts
    per_layer = (d * hd * (2 * h + 2 * k) + 3 * d * f + 2 * d + d * self.num_experts
                 + 3 * d * self.moe_intermediate_size * experts + (d if self.shared_expert_gate else 0)
                 + (hd * (h + 2 * k) if self.qkv_bias else 0) + (d if self.out_bias else 0)
                 + (2 * f + d if self.mlp_bias else 0) + (2 * hd if self.qk_norm else 0)
                 + (2 * d if self.post_norms else 0))
    return self.num_layers * per_layer + self.vocab_size * d * (1 if self.tie_embeddings else 2) + d


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """Inverse frequencies as transformers' ROPE_INIT_FUNCTIONS compute them (default, linear, llama3)."""
  inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
  inv = inv.astype(np.float32)
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


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face config.json <-> ModelConfig

def _rope_from_hf(params: dict | None, theta_default: float, where: str) -> RopeConfig:
  params = dict(params or {})
  kind = params.get("rope_type", params.get("type", "default"))
  if kind not in SUPPORTED_ROPE_TYPES:
    raise ConfigError(f"{where}: rope type {kind!r} is not supported; accepted: {', '.join(SUPPORTED_ROPE_TYPES)}")
  rope = RopeConfig(theta=float(params.get("rope_theta", theta_default)), kind=kind,
                    factor=float(params.get("factor", 1.0)))
  if kind == "llama3":
    try:
      rope = dataclasses.replace(
          rope, low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
          original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    except KeyError as e:
      raise ConfigError(f"{where}: llama3 rope scaling needs key {e.args[0]!r}") from None
  return rope


def _require(hf: dict, key: str, where: str):
  if key not in hf:
    raise ConfigError(f"{where}: missing required key {key!r}")
  return hf[key]


def from_hf_config(hf: dict, where: str = "config.json") -> ModelConfig:
  """Reads both layouts seen in the wild: older `rope_theta`/`rope_scaling`/`torch_dtype` and newer
  `rope_parameters` (flat or per layer type)/`dtype`."""
  model_type = hf.get("model_type")
  if model_type == "gemma3":  # multimodal wrapper: the decoder is described by text_config
    hf = {**_require(hf, "text_config", where), "model_type": "gemma3_text",
          "tie_word_embeddings": hf.get("tie_word_embeddings", True)}
    model_type = "gemma3_text"
  if model_type not in SUPPORTED_MODEL_TYPES:
    raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: "
                      f"{', '.join(SUPPORTED_MODEL_TYPES)}")
  gemma = model_type.startswith("gemma")
  n_layers = int(_require(hf, "num_hidden_layers", where))
  n_heads = int(_require(hf, "num_attention_heads", where))
  hidden = int(_require(hf, "hidden_size", where))
  head_dim = int(hf.get("head_dim") or hidden // n_heads)
  act_name = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
  if act_name not in _ACTIVATIONS:
    raise ConfigError(f"{where}: activation {act_name!r} is not supported; accepted: {', '.join(_ACTIVATIONS)}")
  if hf.get("use_bidirectional_attention"):
    raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (decoder-only causal models)")

  # RoPE: newer files carry `rope_parameters` (Gemma 3: one dict per layer type); older ones `rope_theta` and
  # `rope_scaling` (Gemma 3 adds `rope_local_base_freq` for its sliding layers).
  default_theta = 1_000_000.0 if model_type in ("gemma3_text", "mixtral") else 10_000.0
  params = hf.get("rope_parameters")
  local_rope = None
  if params and isinstance(next(iter(params.values()), None), dict):
    rope = _rope_from_hf(params.get("full_attention"), default_theta, where + " rope_parameters.full_attention")
    local_rope = _rope_from_hf(params.get("sliding_attention"), 10_000.0,
                               where + " rope_parameters.sliding_attention")
  else:
    merged = {"rope_theta": hf.get("rope_theta", default_theta), **(hf.get("rope_scaling") or {}), **(params or {})}
    rope = _rope_from_hf(merged, default_theta, where + " rope_scaling")
    if model_type == "gemma3_text":
      local_rope = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))

  # Which layers slide, per family (transformers' defaults when `layer_types` is absent).
  window = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  qwen = model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
  if qwen and not hf.get("use_sliding_window", False):
    window, layer_types = None, None
  if layer_types is None:
    if model_type == "gemma2":
      layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    elif model_type == "gemma3_text":
      pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
      layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    elif qwen and window is not None:
      first = int(hf.get("max_window_layers", n_layers))
      layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    elif model_type in ("mistral", "mixtral") and window is not None:
      layer_types = ["sliding_attention"] * n_layers
  layer_types = tuple(layer_types or ())
  if "sliding_attention" in layer_types and not window:
    layer_types = ()

  dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  bias = bool(hf.get("attention_bias", False))
  moe = moe_from_hf(hf, model_type, n_layers, where)
  eos = hf.get("eos_token_id")
  return ModelConfig(
      vocab_size=int(_require(hf, "vocab_size", where)), hidden_size=hidden,
      intermediate_size=int(_require(hf, "intermediate_size", where)), num_layers=n_layers, num_heads=n_heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or n_heads), head_dim=head_dim, model_type=model_type,
      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation=_ACTIVATIONS[act_name],
      qkv_bias=bias or model_type == "qwen2" or (model_type == "qwen2_moe" and hf.get("qkv_bias", True)),
      out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
      qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"), norm_offset=1.0 if gemma else 0.0, post_norms=gemma,
      embed_scale=gemma, tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
      query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256) if gemma else None,
      attn_softcap=hf.get("attn_logit_softcapping") if gemma else None,
      final_softcap=hf.get("final_logit_softcapping") if gemma else None,
      rope=rope, local_rope=local_rope, sliding_window=int(window) if window and layer_types else None,
      layer_types=layer_types, bos_token_id=hf.get("bos_token_id"),
      eos_token_id=tuple(eos) if isinstance(eos, list) else eos, pad_token_id=hf.get("pad_token_id"),
      param_dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32",
      dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32", **moe)


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The `config.json` transformers needs to rebuild this model (current `rope_parameters` layout)."""
  arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
          "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
  model_type = cfg.model_type
  if model_type not in arch:
    raise ConfigError(f"model_type {model_type!r} cannot be exported; exportable: {', '.join(arch)}")
  gemma = model_type.startswith("gemma")
  hf: dict[str, Any] = {
      "architectures": [arch[model_type]], "model_type": model_type, "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings, "dtype": cfg.param_dtype,
      "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
      "eos_token_id": list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id,
  }
  act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.activation]
  hf["hidden_activation" if gemma else "hidden_act"] = act
  if model_type in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral"):
    hf["attention_bias"] = cfg.out_bias
  if model_type == "qwen2_moe":
    hf["qkv_bias"] = cfg.qkv_bias
  if cfg.num_experts:
    hf.update(num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob,
              router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=cfg.output_router_logits)
    hf["num_local_experts" if model_type == "mixtral" else "num_experts"] = cfg.num_experts
    if model_type == "mixtral":
      hf["intermediate_size"] = cfg.moe_intermediate_size
    else:
      hf.update(moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
    if model_type == "qwen2_moe":
      hf["shared_expert_intermediate_size"] = cfg.shared_expert_size
  if model_type == "llama":
    hf["mlp_bias"] = cfg.mlp_bias
  if gemma:
    hf["query_pre_attn_scalar"] = cfg.query_pre_attn_scalar or cfg.head_dim
    hf["attn_logit_softcapping"] = cfg.attn_softcap
    hf["final_logit_softcapping"] = cfg.final_softcap
  if model_type == "gemma3_text":
    hf["rope_parameters"] = {"full_attention": cfg.rope.to_hf(),
                             "sliding_attention": (cfg.local_rope or cfg.rope).to_hf()}
  else:
    hf["rope_parameters"] = cfg.rope.to_hf()
  slides = "sliding_attention" in cfg.layer_types
  if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
    hf["use_sliding_window"] = slides
    hf["max_window_layers"] = cfg.layer_types.index("sliding_attention") if slides else cfg.num_layers
  hf["sliding_window"] = cfg.sliding_window if slides else None
  if cfg.layer_types and model_type not in ("mistral", "mixtral"):
    hf["layer_types"] = list(cfg.layer_types)
  return hf


def load_hf_config(path: str) -> tuple[ModelConfig, dict]:
  file = os.path.join(path, "config.json")
  if not os.path.exists(file):
    raise CheckpointError(f"{file}: no config.json in the checkpoint directory {path!r}")
  try:
    with open(file, encoding="utf-8") as f:
      raw = json.load(f)
  except json.JSONDecodeError as e:
    raise ConfigError(f"{file}:{e.lineno}: not valid JSON ({e.msg})") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{file}: expected a JSON object, found {type(raw).__name__}")
  return from_hf_config(raw, where=file), raw


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
