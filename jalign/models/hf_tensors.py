"""How each jalign parameter maps to Hugging Face tensors: names, shapes and the reshapes between HF's per-layer
`[out, in]` Linear weights and jalign's stacked `[layers, in, heads, head_dim]`-style parameters; MoE experts in the
hub's per-expert layout or transformers 5's fused one."""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jalign.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
  """How one HF tensor per layer maps to (a layer slice of) one jalign parameter."""
  hf: str                                     # HF name suffix, "{}" = layer index
  hf_shape: Callable[[ModelConfig], tuple]
  to_jalign: Callable[[np.ndarray, ModelConfig], np.ndarray]
  to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
  # "{e}" in `hf`: one tensor per expert, stacked on the parameter's experts axis. `fused`: the transformers 5 form
  # (its name, its shape, and how to slice this parameter out of it)
  # that holds every expert in one tensor, and how to slice this parameter out of it ([E, ...] -> jalign's form).
  fused: tuple[str, Callable[[ModelConfig], tuple], Callable[[np.ndarray, ModelConfig], np.ndarray]] | None = None
  # (the other parameter, this one's parity): the HF tensor interleaves this parameter's columns with the other's
  # on its last axis, this one's from `parity` (gpt-oss's `gate_up_proj`: gate even, up odd); written once, by the
  # parameter of parity 0.
  joint: tuple[str, int] | None = None


class Columns:
  """Every other column (last axis) of a tensor, from `parity`: read lazily, like the tensor it views."""

  def __init__(self, a, parity: int):
    self.a, self.parity = a, parity
    self.shape = (*a.shape[:-1], a.shape[-1] // 2)

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    index = index + (slice(None),) * (len(self.shape) - len(index))
    return np.asarray(self.a[index[:-1]])[..., self.parity::2][..., index[-1]]


def interleave(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
  """[..., 2n]: `even`'s columns at 0, 2, ..., `odd`'s at 1, 3, ... (the inverse of two `Columns`)."""
  return np.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)


def _proj(heads_attr: str, out: bool = False) -> tuple:
  """q/k/v ([heads*hd, D] <-> [D, heads, hd]) or o ([D, heads*v] <-> [heads, v, D], v the value heads' size)."""
  n = lambda c: getattr(c, heads_attr)
  if out:
    return (lambda c: (c.hidden_size, n(c) * c.v_dim),
            lambda a, c: a.reshape(c.hidden_size, n(c), c.v_dim).transpose(1, 2, 0),
            lambda a, c: a.transpose(2, 0, 1).reshape(c.hidden_size, n(c) * c.v_dim))
  return (lambda c: (n(c) * c.head_dim, c.hidden_size),
          lambda a, c: a.reshape(n(c), c.head_dim, c.hidden_size).transpose(2, 0, 1),
          lambda a, c: a.transpose(1, 2, 0).reshape(n(c) * c.head_dim, c.hidden_size))


def _bias(heads_attr: str) -> tuple:
  n = lambda c: getattr(c, heads_attr)
  return (lambda c: (n(c) * c.head_dim,), lambda a, c: a.reshape(n(c), c.head_dim), lambda a, c: a.reshape(-1))


_same = (lambda a, c: a, lambda a, c: a)
_transpose = (lambda a, c: a.T, lambda a, c: a.T)
_D = lambda c: (c.hidden_size,)
_F = lambda c: (c.mlp_size,)
_H = lambda c: (c.head_dim,)


def _moe_tensors(cfg: ModelConfig, block: str) -> dict[str, Tensor]:
  """The router, the experts (hub layout: one tensor per expert; or transformers 5's fused `gate_up_proj` [E, 2F,
  D] and `down_proj` [E, D, F]) under `block` ("mlp", Mixtral's hub files "block_sparse_moe"), the shared expert
  (Qwen2-MoE's with its gate) and DeepSeek-V3's correction bias."""
  fe = lambda c: c.moe_intermediate_size  # noqa: E731
  names = (("w1", "w3", "w2") if block == "block_sparse_moe" else ("gate_proj", "up_proj", "down_proj"))
  gate_up = (f"{block}.experts.gate_up_proj", lambda c: (c.num_experts, 2 * fe(c), c.hidden_size))
  down = (f"{block}.experts.down_proj", lambda c: (c.num_experts, c.hidden_size, fe(c)))
  t = {
      "router": Tensor(f"{block}.gate.weight", lambda c: (c.num_experts, c.hidden_size), *_transpose),
      "expert_gate": Tensor(f"{block}.experts.{{e}}.{names[0]}.weight", lambda c: (fe(c), c.hidden_size),
                             *_transpose, fused=(*gate_up, lambda a, c: a[:, :fe(c)].transpose(0, 2, 1))),
      "expert_up": Tensor(f"{block}.experts.{{e}}.{names[1]}.weight", lambda c: (fe(c), c.hidden_size),
                           *_transpose, fused=(*gate_up, lambda a, c: a[:, fe(c):].transpose(0, 2, 1))),
      "expert_down": Tensor(f"{block}.experts.{{e}}.{names[2]}.weight", lambda c: (c.hidden_size, fe(c)),
                             *_transpose, fused=(*down, lambda a, c: a.transpose(0, 2, 1))),
  }
  if cfg.shared_expert_gate:
    t["shared_expert_gate"] = Tensor("mlp.shared_expert_gate.weight", lambda c: (1, c.hidden_size),
                                     lambda a, c: a.reshape(-1), lambda a, c: a.reshape(1, -1))
  if cfg.router_score == "sigmoid":
    t["router_correction_bias"] = Tensor(f"{block}.gate.e_score_correction_bias", lambda c: (c.num_experts,), *_same)
  if cfg.shared_expert_size:  # Qwen2-MoE's module is `shared_expert`, DeepSeek-V3's `shared_experts`
    shared = "mlp.shared_experts" if cfg.model_type == "deepseek_v3" else "mlp.shared_expert"
    fs = lambda c: c.shared_expert_size  # noqa: E731
    t["shared_gate"] = Tensor(f"{shared}.gate_proj.weight", lambda c: (fs(c), c.hidden_size), *_transpose)
    t["shared_up"] = Tensor(f"{shared}.up_proj.weight", lambda c: (fs(c), c.hidden_size), *_transpose)
    t["shared_down"] = Tensor(f"{shared}.down_proj.weight", lambda c: (c.hidden_size, fs(c)), *_transpose)
  return t


def _heads_in(size: Callable[[ModelConfig], int], rows: Callable[[ModelConfig], int]) -> tuple:
  """A projection into the heads, [heads * size, rows] <-> [rows, heads, size] (MLA's q_b and kv_b)."""
  return (lambda c: (c.num_heads * size(c), rows(c)),
          lambda a, c: a.reshape(c.num_heads, size(c), rows(c)).transpose(2, 0, 1),
          lambda a, c: a.transpose(1, 2, 0).reshape(c.num_heads * size(c), rows(c)))


def _mla_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
  """DeepSeek-V3's multi-head latent attention: q (or q_a, its norm, q_b), kv_a_proj_with_mqa (latent + RoPE key),
  its norm and kv_b (per head: keys' no-RoPE dims, then values)."""
  rq, rkv = (lambda c: c.q_lora_rank), (lambda c: c.kv_lora_rank)  # noqa: E731
  t = {
      "kv_a": Tensor("self_attn.kv_a_proj_with_mqa.weight",
                     lambda c: (c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size), *_transpose),
      "kv_a_norm": Tensor("self_attn.kv_a_layernorm.weight", lambda c: (c.kv_lora_rank,), *_same),
      "kv_b": Tensor("self_attn.kv_b_proj.weight",
                     *_heads_in(lambda c: c.head_dim - c.qk_rope_head_dim + c.v_head_dim, rkv)),
  }
  if cfg.q_lora_rank:
    t["q_a"] = Tensor("self_attn.q_a_proj.weight", lambda c: (c.q_lora_rank, c.hidden_size), *_transpose)
    t["q_a_norm"] = Tensor("self_attn.q_a_layernorm.weight", lambda c: (c.q_lora_rank,), *_same)
    t["q_b"] = Tensor("self_attn.q_b_proj.weight", *_heads_in(lambda c: c.head_dim, rq))
  else:
    t["q"] = Tensor("self_attn.q_proj.weight", *_proj("num_heads"))
  return t


def _gpt_oss_tensors() -> dict[str, Tensor]:
  """gpt-oss's router (with its bias) and experts, every expert of a layer in one tensor: `gate_up_proj` [E, D, 2F]
  (gate and up interleaved), `down_proj` [E, F, D], and their biases (the plain layout; the hub's MXFP4 one is
  dequantised on load, `models.mxfp4`)."""
  fe = lambda c: c.moe_intermediate_size  # noqa: E731
  gate_up = ("mlp.experts.gate_up_proj", lambda c: (c.num_experts, c.hidden_size, 2 * fe(c)))
  gate_up_bias = ("mlp.experts.gate_up_proj_bias", lambda c: (c.num_experts, 2 * fe(c)))

  def half(parity: int) -> tuple:
    return lambda a, c: Columns(a, parity), lambda a, c: a

  return {
      "router": Tensor("mlp.router.weight", lambda c: (c.num_experts, c.hidden_size), *_transpose),
      "router_bias": Tensor("mlp.router.bias", lambda c: (c.num_experts,), *_same),
      "expert_gate": Tensor(*gate_up, *half(0), joint=("expert_up", 0)),
      "expert_up": Tensor(*gate_up, *half(1), joint=("expert_gate", 1)),
      "expert_down": Tensor("mlp.experts.down_proj", lambda c: (c.num_experts, fe(c), c.hidden_size), *_same),
      "expert_gate_bias": Tensor(*gate_up_bias, *half(0), joint=("expert_up_bias", 0)),
      "expert_up_bias": Tensor(*gate_up_bias, *half(1), joint=("expert_gate_bias", 1)),
      "expert_down_bias": Tensor("mlp.experts.down_proj_bias", lambda c: (c.num_experts, c.hidden_size), *_same),
  }


def layer_tensors(cfg: ModelConfig, moe_block: str = "mlp") -> dict[str, Tensor]:
  """jalign layer parameter name -> HF tensor, for the parameters this config has (`moe_block`: the experts' module
  name, see `_moe_tensors`)."""
  gemma = cfg.post_norms
  shape_f = lambda c: (c.mlp_size, c.hidden_size)  # noqa: E731
  t = {
      "attn_norm": Tensor("input_layernorm.weight", _D, *_same),
      # Llama's "post_attention_layernorm" is the pre-MLP norm; Gemma 2/3 name that one "pre_feedforward".
      "ffw_norm": Tensor("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight",
                          _D, *_same),
  }
  t["o"] = Tensor("self_attn.o_proj.weight", *_proj("num_heads", out=True))
  if cfg.kv_lora_rank:
    t.update(_mla_tensors(cfg))
  else:
    t.update(q=Tensor("self_attn.q_proj.weight", *_proj("num_heads")),
             k=Tensor("self_attn.k_proj.weight", *_proj("num_kv_heads")),
             v=Tensor("self_attn.v_proj.weight", *_proj("num_kv_heads")))
  if cfg.mlp_size:  # a dense model's MLP, or an MoE model's dense layers'
    t["gate"] = Tensor("mlp.gate_proj.weight", shape_f, *_transpose)
    t["up"] = Tensor("mlp.up_proj.weight", shape_f, *_transpose)
    t["down"] = Tensor("mlp.down_proj.weight", lambda c: (c.hidden_size, c.mlp_size), *_transpose)
  if cfg.num_experts:
    t.update(_gpt_oss_tensors() if cfg.model_type == "gpt_oss" else _moe_tensors(cfg, moe_block))
  if cfg.attn_sinks:
    t["sinks"] = Tensor("self_attn.sinks", lambda c: (c.num_heads,), *_same)
  if cfg.qkv_bias:
    t["q_bias"] = Tensor("self_attn.q_proj.bias", *_bias("num_heads"))
    t["k_bias"] = Tensor("self_attn.k_proj.bias", *_bias("num_kv_heads"))
    t["v_bias"] = Tensor("self_attn.v_proj.bias", *_bias("num_kv_heads"))
  if cfg.out_bias:
    t["o_bias"] = Tensor("self_attn.o_proj.bias", _D, *_same)
  if cfg.qk_norm:
    t["q_norm"] = Tensor("self_attn.q_norm.weight", _H, *_same)
    t["k_norm"] = Tensor("self_attn.k_norm.weight", _H, *_same)
  if cfg.post_norms:
    t["post_attn_norm"] = Tensor("post_attention_layernorm.weight", _D, *_same)
    t["post_ffw_norm"] = Tensor("post_feedforward_layernorm.weight", _D, *_same)
  if cfg.mlp_bias:
    t["gate_bias"] = Tensor("mlp.gate_proj.bias", _F, *_same)
    t["up_bias"] = Tensor("mlp.up_proj.bias", _F, *_same)
    t["down_bias"] = Tensor("mlp.down_proj.bias", _D, *_same)
  return t


def top_tensors(cfg: ModelConfig) -> dict[str, Tensor]:
  t = {"embed": Tensor("embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size), *_same),
       "final_norm": Tensor("norm.weight", _D, *_same)}
  if not cfg.tie_embeddings:
    t["lm_head"] = Tensor("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), *_transpose)
  return t


class ExpertStack:
  """Per-expert tensors seen as one [E, ...] array: indexing reads only the experts (and slices) a shard asks for."""

  def __init__(self, experts: list):
    self.experts = experts
    self.shape = (len(experts), *experts[0].shape)

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    return np.stack([np.asarray(a[index[1:]]) for a in self.experts[index[0]]])
