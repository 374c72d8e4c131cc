"""Multi-head latent attention (DeepSeek-V2/V3): the queries, keys and values a decoder layer's attention reads."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jalign.models import lora as lora_lib
from jalign.models.attention import apply_rope
from jalign.models.config import ModelConfig


def qkv(cfg: ModelConfig, h_BxTxD, lp: dict, proj, norm, positions_BxT, inv_freq_H2, *, absorbed: bool,
        lora: lora_lib.LoraConfig | None):
  """Multi-head latent attention's queries, keys and values (DeepSeek-V2, arXiv:2405.04434, sec. 2.1), and the map
  from attention's output per head to o's input. `proj(x, name)`: the layer's projection (with its adapter);
  `norm(x, w)`: its RMSNorm. Each token's keys and values come from one latent c (kv_lora_rank,
  normed) through kv_b, beside one RoPE key shared by the heads.

  Expanded (training, scoring): per-head keys [k_nope, k_rope] and values; q, k and v zero-padded to one head size
  (zeros add nothing to q . k; the output's pad is cut). Absorbed (`absorbed`, decoding over a cache): kv_b's key
  half folded into the queries and its value half applied after attention, so keys and values are the one shared
  head [c, k_rope] the cache holds (`ModelConfig.cache_shape`): q . k = (q_nope W_k) . c + q_rope . k_rope
  (sec. 2.1.3 of the paper), attention's output over it is sum p c, and W_v maps that to each head's value."""
  R, Hr, N = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_heads
  Hn, Hv = cfg.head_dim - Hr, cfg.v_dim
  rope = functools.partial(apply_rope, positions_BxT=positions_BxT, inv_freq_H2=inv_freq_H2, scale=cfg.rope.scale,
                           interleave=cfg.rope_interleave)
  q = proj(norm(proj(h_BxTxD, "q_a"), lp["q_a_norm"]), "q_b") if cfg.q_lora_rank else proj(h_BxTxD, "q")
  q_nope, q_rope = q[..., :Hn], rope(q[..., Hn:])
  latent = proj(h_BxTxD, "kv_a")
  c_BxTxR = norm(latent[..., :R], lp["kv_a_norm"])
  k_rope = rope(latent[..., None, R:])  # [B, T, 1, Hr]
  if absorbed:
    w_kv = lora_lib.folded(lp, "kv_b", lora).astype(h_BxTxD.dtype)  # [R, N, Hn + Hv]
    q_c = jnp.einsum("btnh,rnh->btnr", q_nope, w_kv[..., :Hn])
    kv = jnp.concatenate([c_BxTxR[:, :, None], k_rope], axis=-1)
    # Values are the keys: attention's output past the latent's R dims is not read.
    return (jnp.concatenate([q_c, q_rope], axis=-1), kv, kv,
            lambda a: jnp.einsum("btnr,rnv->btnv", a[..., :R], w_kv[..., Hn:]))
  kv = proj(c_BxTxR, "kv_b")  # [B, T, N, Hn + Hv]
  size = max(cfg.head_dim, Hv)
  pad = lambda a: jnp.pad(a, [(0, 0)] * 3 + [(0, size - a.shape[-1])])  # noqa: E731
  k = jnp.concatenate([kv[..., :Hn], jnp.broadcast_to(k_rope, (*k_rope.shape[:2], N, Hr))], axis=-1)
  return (pad(jnp.concatenate([q_nope, q_rope], axis=-1)), pad(k), pad(kv[..., Hn:]), lambda a: a[..., :Hv])
