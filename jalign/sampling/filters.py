"""Turning next-token logits into a sample and its log-probability.

The log-probability returned is that of the sampled token under the distribution it was actually drawn from:
logits / temperature, then restricted by top-k, top-p (nucleus) and min-p and renormalised over the tokens kept.
With temperature 0 (greedy) the argmax is taken and its log-probability under the untempered softmax is returned.
Policy-gradient code that needs the model's own (unfiltered) log-probs recomputes them from the sequences.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30


def row_keys(rng: jax.Array, request_B: jax.Array, step_B: jax.Array) -> jax.Array:
  """One key per (request, step) [B]: a request's draws do not depend on the batch, the slot or the other rows it
  was sampled with (static and continuous batching give the same samples for the same seed)."""
  return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(rng, r), t))(request_B, step_B)


def filter_logits(logits_BxV: jax.Array, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  min_p: float = 0.0) -> jax.Array:
  """logits / temperature with the tokens outside the kept set (top-k, then top-p, then min-p) at -1e30: the
  distribution a draw comes from, and (on the trainer's logits) the same kept set for importance ratios."""
  logits = logits_BxV.astype(jnp.float32) / temperature
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, _NEG, logits)
  if top_p < 1.0:
    # Keep the smallest set of most likely tokens whose probability reaches top_p (always at least one).
    sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly more likely tokens
    cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, _NEG, logits)
  if min_p > 0.0:
    probs = jax.nn.softmax(logits, axis=-1)
    logits = jnp.where(probs < min_p * jnp.max(probs, axis=-1, keepdims=True), _NEG, logits)
  return logits


def sample_logits(logits_BxV: jax.Array, keys_B: jax.Array, *, temperature: float = 1.0, top_k: int = 0,
                  top_p: float = 1.0, min_p: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """(token_B int32, logprob_B float32); `keys_B`: one key per row (`row_keys`)."""
  logits = logits_BxV.astype(jnp.float32)
  if temperature == 0.0:
    token = jnp.argmax(logits, axis=-1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], -1)[:, 0]
  logp = jax.nn.log_softmax(filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
                            axis=-1)
  # Inverse-CDF sampling: one uniform per row instead of a Gumbel draw per vocabulary entry (jax.random.categorical),
  # ~3x cheaper per decode step on CPU. The draw is never exactly 0, so a zero-probability token is never chosen.
  cdf = jnp.cumsum(jnp.exp(logp), axis=-1)
  u = jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32, minval=jnp.finfo(jnp.float32).tiny))(keys_B)
  token = jnp.minimum(jnp.sum(cdf < u * cdf[:, -1:], axis=-1), logits.shape[-1] - 1)
  return token.astype(jnp.int32), jnp.take_along_axis(logp, token[:, None], -1)[:, 0]
