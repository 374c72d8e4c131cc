"""token_logprobs: the one place the LM head meets the loss.

`impl="xla"` is the plain reference: it materialises the [T, V] logits (fine for small vocabularies and tests).
`impl="chunked"` walks the vocabulary in chunks with an online logsumexp and a custom backward, so neither pass holds
more than [T, chunk] logits. `auto` picks chunked once the vocabulary exceeds one chunk.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jalign.kernels.chunked import token_logprobs_chunked

IMPLS = ("xla", "chunked", "auto")


def token_logprobs(hidden_TxD: jax.Array, unembed_DxV: jax.Array, targets_T: jax.Array, *,
                   temperature: float = 1.0, softcap: float | None = None, impl: str = "xla", chunk: int = 4096):
  """(logprobs_T, entropy_T, logsumexp_T) of `targets_T` under softmax(cap(hidden @ unembed) / temperature).

  Leading dims of `hidden`/`targets` beyond T are allowed ([B, T, D] -> [B, T]). Accumulates in fp32."""
  if impl not in IMPLS:
    raise ValueError(f"token_logprobs impl {impl!r}; available: {', '.join(IMPLS)}")
  lead = targets_T.shape
  hidden = hidden_TxD.reshape(-1, hidden_TxD.shape[-1])  # flat 2-D matmuls: much faster backward on CPU
  if impl == "auto":
    impl = "chunked" if unembed_DxV.shape[1] > chunk else "xla"
  if impl == "chunked":
    out = token_logprobs_chunked(hidden, unembed_DxV, targets_T.reshape(-1), temperature=temperature,
                                 softcap=softcap, chunk=chunk)
    return tuple(x.reshape(lead) for x in out)
  logits = jnp.dot(hidden, unembed_DxV.astype(hidden.dtype), preferred_element_type=jnp.float32)
  if softcap is not None:  # Gemma 2 final-logit soft-capping
    logits = jnp.tanh(logits / softcap) * softcap
  logits = logits / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  # Selecting the target through a one-hot product keeps the backward elementwise (a gather's is a scatter).
  onehot = jax.nn.one_hot(targets_T.reshape(-1), logits.shape[-1], dtype=logits.dtype)
  target_logp = jnp.sum(logits * onehot, axis=-1) - lse
  probs = jnp.exp(logits - lse[:, None])
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return target_logp.reshape(lead), entropy.reshape(lead), lse.reshape(lead)
