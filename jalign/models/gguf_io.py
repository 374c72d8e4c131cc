"""llama.cpp GGUF files in: the metadata as an HF config.json dict, each tensor dequantised to float32 (by the `gguf`
package's own NumPy kernels) under its HF name and layout, so `hf.from_pretrained` loads a `.gguf` the way it loads
safetensors.

Layout differences undone here (as llama.cpp's `convert_hf_to_gguf.py` makes them): GGUF stores Llama's q/k
projection rows permuted from HF's rotate-half order into interleaved RoPE pairs; Qwen2/Qwen3 are stored as HF has
them. Supported architectures: llama (Llama 2/3.0, Mistral, SmolLM), qwen2, qwen3.
"""
from __future__ import annotations

import re

import numpy as np

from jalign.core import gguf_reader
from jalign.core.errors import CheckpointError

ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}   # GGUF general.architecture -> model_type
_PERMUTED = {"llama"}   # q/k rows interleaved for llama.cpp's RoPE

# GGUF tensor name -> HF tensor name ("{}" = layer index)
_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
_PATTERNS = [(re.compile("^" + re.escape(g).replace(r"\{\}", r"(\d+)") + "$"), h) for g, h in _NAMES.items()]


def _hf_name(name: str) -> str | None:
  for pattern, hf in _PATTERNS:
    m = pattern.match(name)
    if m:
      return hf.format(*m.groups())
  return None


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """Inverse of convert_hf_to_gguf's `permute`: rows [heads, 2, hd/2] (interleaved pairs) -> [heads, hd/2, 2]."""
  half = w.shape[0] // heads // 2
  return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GgufFile:
  """One `.gguf` file: `config` (an HF config.json dict), `keys()` (HF tensor names) and `get(name)` (float32 in HF's
  layout), the interface `hf.from_pretrained` reads checkpoints through."""

  def __init__(self, path: str):
    self.path = path
    self._reader, meta = gguf_reader.read(path, CheckpointError)
    from gguf.quants import dequantize  # importable: read() has imported gguf
    self._dequantize = dequantize
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
      raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                            f"{', '.join(ARCHITECTURES)}")
    self._arch = arch
    self._tensors, unknown = {}, []
    for t in self._reader.tensors:
      hf = _hf_name(t.name)
      if hf is None:
        unknown.append(t.name)
      else:
        self._tensors[hf] = t
    if unknown:  # e.g. Llama 3.1's rope_freqs (RoPE scaling factors), which this reader does not apply
      raise CheckpointError(f"{path}: GGUF tensors this reader does not map: {', '.join(unknown[:8])}")
    self.config = self._hf_config(meta)

  def _hf_config(self, meta: dict) -> dict:
    a = self._arch

    def need(key):
      if f"{a}.{key}" not in meta:
        raise CheckpointError(f"{self.path}: GGUF metadata has no {a}.{key}")
      return meta[f"{a}.{key}"]

    if f"{a}.rope.scaling.type" in meta and meta[f"{a}.rope.scaling.type"] not in ("none", ""):
      raise CheckpointError(f"{self.path}: RoPE scaling {meta[f'{a}.rope.scaling.type']!r} in GGUF is not read")
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    embed = self._tensors["model.embed_tokens.weight"]
    cfg = {
        "model_type": ARCHITECTURES[a], "architectures": [f"{a.capitalize()}ForCausalLM"],
        "hidden_size": hidden, "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(f"{a}.attention.head_count_kv", heads)),
        "head_dim": int(meta.get(f"{a}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(meta.get(f"{a}.vocab_size", int(embed.shape[-1]))),
        "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        "hidden_act": "silu", "torch_dtype": "float32",
        # Llama's attention_bias biases q/k/v/o; Qwen2's q/k/v biases come with its model_type
        "attention_bias": a == "llama" and "model.layers.0.self_attn.q_proj.bias" in self._tensors,
    }
    for ours, theirs in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                         ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                         ("pad_token_id", "tokenizer.ggml.padding_token_id")):
      if theirs in meta:
        cfg[ours] = int(meta[theirs])
    return cfg

  def keys(self):
    return self._tensors.keys()

  def get(self, name: str) -> np.ndarray:
    t = self._tensors[name]
    w = np.asarray(self._dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape(tuple(int(n) for n in reversed(t.shape)))   # GGUF lists dimensions innermost first
    if self._arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
      heads = self.config["num_attention_heads"] if "q_proj" in name else self.config["num_key_value_heads"]
      w = _unpermute(w, heads)
    return w
