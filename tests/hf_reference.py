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
}
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_dense_layers", "gpt_oss")


def build(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
  config_cls, model_cls, extra = FAMILIES[family]
  torch.manual_seed(seed)
  config = config_cls(**{**BASE, **extra, **overrides})
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.normal_(0.0, 0.1 if "norm" in name or "bias" in name else 1.0 if "sinks" in name else 0.15)
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
