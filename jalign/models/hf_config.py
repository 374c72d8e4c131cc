"""A Hugging Face `config.json` as a `ModelConfig` and back: each family's keys, defaults and quirks."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jalign.core.errors import CheckpointError, ConfigError
from jalign.models.config import ModelConfig, RopeConfig
from jalign.models.moe import moe_from_hf

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "qwen2_moe",
                         "qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# gpt-oss's transformers defaults when its config.json leaves rope_parameters out
_GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _rope_from_hf(params: dict | None, theta_default: float, where: str, max_positions: int = 2048) -> RopeConfig:
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
  if kind == "yarn":
    if "original_max_position_embeddings" not in params:
      raise ConfigError(f"{where}: yarn rope scaling needs key 'original_max_position_embeddings'")
    original = int(params["original_max_position_embeddings"])
    factor = float(params.get("factor") or max_positions / original)
    attention = params.get("attention_factor")
    mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None and mscale and mscale_all:  # DeepSeek's form (transformers `_compute_yarn_parameters`)
      m = lambda s: 0.1 * s * math.log(factor) + 1.0 if factor > 1 else 1.0  # noqa: E731
      attention = m(float(mscale)) / m(float(mscale_all))
    rope = dataclasses.replace(rope, mscale_all_dim=float(mscale_all or 0.0))
    rope = dataclasses.replace(
        rope, factor=factor, original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)), attention_factor=None if attention is None else float(attention))
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
  mla = _mla_from_hf(hf, where) if model_type == "deepseek_v3" else {}
  head_dim = mla.pop("head_dim", head_dim)
  act_name = hf.get("hidden_activation") or hf.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
  if act_name not in _ACTIVATIONS:
    raise ConfigError(f"{where}: activation {act_name!r} is not supported; accepted: {', '.join(_ACTIVATIONS)}")
  if hf.get("use_bidirectional_attention"):
    raise ConfigError(f"{where}: use_bidirectional_attention=true is not supported (decoder-only causal models)")

  # RoPE: newer files carry `rope_parameters` (Gemma 3: one dict per layer type); older ones `rope_theta` and
  # `rope_scaling` (Gemma 3 adds `rope_local_base_freq` for its sliding layers).
  default_theta = {"gemma3_text": 1e6, "mixtral": 1e6, "gpt_oss": 150_000.0}.get(model_type, 10_000.0)
  params = hf.get("rope_parameters")
  max_positions = int(hf.get("max_position_embeddings", 2048))
  if model_type == "gpt_oss":
    hf = {"sliding_window": 128, **hf}
    if not params and not hf.get("rope_scaling"):
      params = _GPT_OSS_ROPE
  local_rope = None
  if params and isinstance(next(iter(params.values()), None), dict):
    rope = _rope_from_hf(params.get("full_attention"), default_theta, where + " rope_parameters.full_attention",
                         max_positions)
    local_rope = _rope_from_hf(params.get("sliding_attention"), 10_000.0,
                               where + " rope_parameters.sliding_attention", max_positions)
  else:
    merged = {"rope_theta": hf.get("rope_theta", default_theta), **(hf.get("rope_scaling") or {}), **(params or {})}
    rope = _rope_from_hf(merged, default_theta, where + " rope_scaling", max_positions)
    if model_type == "gemma3_text":
      local_rope = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))

  # Which layers slide, per family (transformers' defaults when `layer_types` is absent).
  window = hf.get("sliding_window")
  layer_types = hf.get("layer_types")
  qwen = model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
  if qwen and not hf.get("use_sliding_window", False):
    window, layer_types = None, None
  if layer_types is None:
    if model_type in ("gemma2", "gpt_oss"):
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
  bias = bool(hf.get("attention_bias", model_type == "gpt_oss"))
  moe = moe_from_hf(hf, model_type, n_layers, where)
  eos = hf.get("eos_token_id")
  return ModelConfig(
      vocab_size=int(_require(hf, "vocab_size", where)), hidden_size=hidden,
      intermediate_size=int(_require(hf, "intermediate_size", where)), num_layers=n_layers, num_heads=n_heads,
      num_kv_heads=n_heads if mla else int(hf.get("num_key_value_heads") or n_heads), head_dim=head_dim,
      model_type=model_type,
      max_position_embeddings=max_positions, attn_sinks=model_type == "gpt_oss",
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5 if model_type == "gpt_oss" else 1e-6)), activation=_ACTIVATIONS[act_name],
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
      dtype=dtype if dtype in ("float32", "bfloat16", "float16") else "float32", **moe, **mla)


def _mla_from_hf(hf: dict, where: str) -> dict[str, Any]:
  """DeepSeek-V3's multi-head latent attention sizes (transformers' `DeepseekV3Config` defaults)."""
  if hf.get("attention_bias"):
    raise ConfigError(f"{where}: attention_bias=true: DeepSeek-V3 is supported without attention biases")
  rope, nope = int(hf.get("qk_rope_head_dim", 64)), int(hf.get("qk_nope_head_dim", 128))
  return dict(kv_lora_rank=int(hf.get("kv_lora_rank", 512)), q_lora_rank=int(hf.get("q_lora_rank", 1536) or 0),
              qk_rope_head_dim=rope, head_dim=nope + rope, v_head_dim=int(hf.get("v_head_dim", 128)),
              rope_interleave=bool(hf.get("rope_interleave", True)))


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
  """The `config.json` transformers needs to rebuild this model (current `rope_parameters` layout)."""
  arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
          "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
          "gpt_oss": "GptOssForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
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
  if model_type in ("llama", "mistral", "qwen3", "qwen3_moe", "mixtral", "gpt_oss"):
    hf["attention_bias"] = cfg.out_bias
  if model_type == "qwen2_moe":
    hf["qkv_bias"] = cfg.qkv_bias
  if cfg.num_experts and model_type != "deepseek_v3":
    hf.update(num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=cfg.norm_topk_prob,
              router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=cfg.output_router_logits)
    hf["num_local_experts" if model_type in ("mixtral", "gpt_oss") else "num_experts"] = cfg.num_experts
    if model_type in ("mixtral", "gpt_oss"):
      hf["intermediate_size"] = cfg.moe_intermediate_size
      if model_type == "gpt_oss":
        hf.update(swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        del hf["norm_topk_prob"]
    else:
      hf.update(moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1,
                mlp_only_layers=list(cfg.mlp_only_layers))
    if model_type == "qwen2_moe":
      hf["shared_expert_intermediate_size"] = cfg.shared_expert_size
  if model_type == "deepseek_v3":
    hf = _deepseek_to_hf(cfg, hf)
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


def _deepseek_to_hf(cfg: ModelConfig, hf: dict[str, Any]) -> dict[str, Any]:
  dense = cfg.mlp_only_layers
  if dense != tuple(range(len(dense))) or (cfg.num_experts and cfg.shared_expert_size % cfg.moe_intermediate_size):
    raise ConfigError(f"DeepSeek-V3 export: mlp_only_layers={list(dense)} must be the first layers "
                      "(first_k_dense_replace) and shared_expert_size a multiple of moe_intermediate_size")
  del hf["head_dim"]  # transformers derives it (qk_rope_head_dim for RoPE)
  hf.update(attention_bias=False, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank or None,
            qk_rope_head_dim=cfg.qk_rope_head_dim, qk_nope_head_dim=cfg.head_dim - cfg.qk_rope_head_dim,
            v_head_dim=cfg.v_head_dim, rope_interleave=cfg.rope_interleave, n_routed_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.moe_intermediate_size,
            n_shared_experts=cfg.shared_expert_size // cfg.moe_intermediate_size, first_k_dense_replace=len(dense),
            norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor,
            n_group=cfg.expert_groups, topk_group=cfg.groups_per_token, num_nextn_predict_layers=0,
            output_router_logits=cfg.output_router_logits)
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
