"""RoPE and position ids as pure functions on arrays (attention itself: `jalign.kernels.attention`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def positions_from_mask(mask_BxT: jax.Array) -> jax.Array:
  """Position ids as transformers' `generate` derives them: count of real tokens before, pads at 0."""
  mask = mask_BxT.astype(jnp.int32)
  return jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0) * mask


def apply_rope(x_BxTxNxH: jax.Array, positions_BxT: jax.Array, inv_freq_H2: jax.Array, scale: float = 1.0,
               interleave: bool = False) -> jax.Array:
  """Rotate-half RoPE (the layout of HF checkpoints); angles in fp32, cos and sin times `scale` (YaRN's attention
  factor), cast like transformers does. `interleave`: pairs (x0, x1), (x2, x3)... rotate together (DeepSeek's
  layout); the result is laid out even dims then odd ones, as transformers' `apply_rotary_pos_emb_interleave` does
  (the same permutation on queries and keys, so their dot products are unchanged)."""
  if interleave:
    x_BxTxNxH = jnp.concatenate([x_BxTxNxH[..., 0::2], x_BxTxNxH[..., 1::2]], axis=-1)
  angles_BxTxH2 = positions_BxT[..., None].astype(jnp.float32) * inv_freq_H2.astype(jnp.float32)
  angles_BxTxH = jnp.concatenate([angles_BxTxH2, angles_BxTxH2], axis=-1)
  cos = (jnp.cos(angles_BxTxH) * scale)[:, :, None, :].astype(x_BxTxNxH.dtype)
  sin = (jnp.sin(angles_BxTxH) * scale)[:, :, None, :].astype(x_BxTxNxH.dtype)
  x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return x_BxTxNxH * cos + rotated * sin
