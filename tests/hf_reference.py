"""Tiny random Hugging Face models of each supported family, built offline with transformers + CPU torch.

Weights are re-drawn with a larger spread than HF's init (norm scales and biases included) so every parameter
visibly affects the logits; sizes are small enough that each model builds and runs in well under a second.
"""
from __future__ import annotations

import numpy as np
import torch
import transformers

BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, attn_implementation="eager")

# name -> (transformers config class, model class, extra config kwargs)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama3_rope_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32))),
    "llama_linear_rope_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        attention_bias=True, mlp_bias=True, rope_parameters=dict(rope_type="linear", rope_theta=10000.0,
                                                                  factor=4.0))),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=4)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=12, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, dict(
        head_dim=16, query_pre_attn_scalar=12, sliding_window=4, layer_types=[
            "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", rope_theta=1e6, factor=8.0),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # Mixture of Experts: 6 experts, top 2 (every layer sparse).
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=6, num_experts_per_tok=2, intermediate_size=24, sliding_window=4)),
    # Dense and sparse layers mixed: layer 2's MLP is dense (intermediate_size), layers 0, 1 and 3 routed.
    "qwen3_moe_dense_layers": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, num_hidden_layers=4,
        mlp_only_layers=[2])),
    # gpt-oss: attention sinks and biases, alternating sliding / full layers, YaRN, a biased router, biased experts
    # with a clamped SwiGLU (a limit low enough that the clamp bites at these weights).
    "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM, dict(
        head_dim=16, num_local_experts=6, num_experts_per_tok=2, intermediate_size=24, sliding_window=4,
        swiglu_limit=0.05, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=8.0,
                                                beta_slow=1.0, truncate=False, original_max_position_embeddings=16))),
    # DeepSeek-V3: multi-head latent attention (a query bottleneck, interleaved RoPE, YaRN with DeepSeek's mscale,
    # values narrower than keys), sigmoid routing over 4 groups of 2 (2 kept) with a correction bias, scaled gates,
    # 2 shared experts, the first layer dense.
    "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=2,
        moe_intermediate_size=12, first_k_dense_replace=1, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=100.0, factor=4.0, original_max_position_embeddings=32,
                             mscale=2.0, mscale_all_dim=3.0, beta_fast=8.0, beta_slow=1.0))),
    # ... and its other layouts: one query projection, RoPE over halves, one group, gates not renormalised, values
    # wider than keys, every layer sparse.
    "deepseek_v3_q_proj": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=20, n_routed_experts=6, n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=12, first_k_dense_replace=0, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_interleave=False)),
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_dense_layers", "gpt_oss", "deepseek_v3",
                "deepseek_v3_q_proj")


def build(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  config = config_cls(**{**BASE, **extra, **overrides})
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.1 if "norm" in name or "bias" in name else 1.0 if "sinks" in name else 0.15)
      if "a_layernorm" in name:  # MLA's latent norms near 1, so its queries and keys are not near 0
        p.normal_(1.0, 0.1)
    for name, b in model.named_buffers():
      if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias: a buffer, zero at init
        b.normal_(0.0, 0.1)
  return model


def save(model, path, **kw) -> str:
  model.save_pretrained(path, **kw)
  return str(path)


def batch(vocab: int, pads=(0, 2, 5), length: int = 10, seed: int = 0):
  """Token ids and a left-padded attention mask (row i has pads[i] leading pads)."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, vocab, (len(pads), length)).astype(np.int64)
  mask = np.ones_like(ids)
  for row, pad in enumerate(pads):
    mask[row, :pad] = 0
  return ids, mask


def hf_logits(model, ids, mask) -> np.ndarray:
  """transformers logits with the position ids its `generate` uses for left padding."""
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                position_ids=torch.tensor(positions))
  return out.logits.float().numpy()


def max_diff(a, b, mask) -> float:
  """max |a - b| over real (non-pad) positions."""
  return float(np.abs((np.asarray(a, np.float32) - np.asarray(b, np.float32)) * mask[..., None]).max())
