"""RoPE, masks and grouped-query attention as pure functions on arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = -1e30  # finite, so fully masked (padding) rows stay NaN-free


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """Position ids as transformers' `generate` derives them: count of real tokens before, pads at 0."""
  mask = mask_BxT.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq_H2: jax.Array) -> jax.Array:
  """Rotate-half RoPE (the layout of HF checkpoints); angles in fp32, cast like transformers does."""
  angles_BxTxH2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq_H2.astype(jnp.float32)
  angles_BxTxH = jnp.concatenate([angles_BxTxH2, angles_BxTxH2], axis=-1)
  cos = jnp.cos(angles_BxTxH)[:, :, None, :].astype(x_BxTxNxH.dtype)
  sin = jnp.sin(angles_BxTxH)[:, :, None, :].astype(x_BxTxNxH.dtype)
  x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxH * cos + rotated * sin


def attention_mask(q_segment_BxT, k_segment_BxS, q_index_T, window) -> jax.Array:
  """Boolean [B, T, S]: same segment (0 = padding / empty cache slot), causal over slot indices, and within the
  sliding window when `window` > 0 (transformers: kv_idx > q_idx - window)."""
  k_index_S = jnp.arange(k_segment_BxS.shape[1])
  same = (q_segment_BxT[:, :, None] == k_segment_BxS[:, None, :]) & (k_segment_BxS[:, None, :] != 0)
  causal = k_index_S[None, :] <= q_index_T[:, None]
  local = jnp.where(window > 0, q_index_T[:, None] - k_index_S[None, :] < window, True)
  return same & (causal & local)[None]


def gqa_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, *, scale: float, softcap: float | None,
                  kv_heads_first: bool = False):
  """Softmax attention with N query heads sharing K key/value heads; scores and softmax in fp32.
  `kv_heads_first`: keys and values come as [B, K, S, H] (the decoding cache's layout) instead of [B, S, K, H].

  (Two batched matmuls over (batch x kv-head), [B*K, G*T, H] @ [B*K, H, S], run the backward ~15% faster on XLA's
  CPU backend but round differently; the shipped tiny policy's SFT recipe is sensitive enough to that to land
  elsewhere, so the change waits for the next retraining of the shipped assets: see benchmarks/README.md.)"""
  b, t, n, h = q_BxTxNxH.shape
  k = k_BxSxKxH.shape[1 if kv_heads_first else 2]
  kv = "bksh" if kv_heads_first else "bskh"
  q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, n // k, h)
  scores = jnp.einsum(f"btkgh,{kv}->bkgts", q_BxTxKxGxH, k_BxSxKxH,
                      preferred_element_type=jnp.float32) * scale
  if softcap is not None:  # Gemma 2: tanh soft-capping of the scores, before the mask
    scores = jnp.tanh(scores / softcap) * softcap
  scores = jnp.where(mask_BxTxS[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxH.dtype)
  out = jnp.einsum(f"bkgts,{kv}->btkgh", probs, v_BxSxKxH)
  return out.reshape(b, t, n, h)
