"""token_logprobs: the one place the LM head meets the loss.

`impl="xla"` is the plain reference: it materialises the [T, V] logits (fine for small vocabularies and tests).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("xla",)


def token_logprobs(hidden_TxD: jax.Array, unembed_DxV: jax.Array, targets_T: jax.Array, *,
                   temperature: float = 1.0, softcap: float | None = None, impl: str = "xla"):
  """(logprobs_T, entropy_T, logsumexp_T) of `targets_T` under softmax(cap(hidden @ unembed) / temperature).

  Leading dims of `hidden`/`targets` beyond T are allowed ([B, T, D] -> [B, T]). Accumulates in fp32."""
  if impl not in IMPLS:
    raise ValueError(f"token_logprobs impl {impl!r}; available: {', '.join(IMPLS)}")
  logits = jnp.einsum("...d,dv->...v", hidden_TxD, unembed_DxV.astype(hidden_TxD.dtype),
                      preferred_element_type=jnp.float32)
  if softcap is not None:  # Gemma 2 final-logit soft-capping
    logits = jnp.tanh(logits / softcap) * softcap
  logits = logits / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  logp_all = logits - lse[..., None]
  target_logp = jnp.take_along_axis(logp_all, targets_T[..., None].astype(jnp.int32), axis=-1)[..., 0]
  entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
  return target_logp, entropy, lse
