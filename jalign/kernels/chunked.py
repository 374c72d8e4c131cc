"""Chunked log-prob / entropy / logsumexp over the vocabulary: never materialises [tokens, vocab] logits.

The forward walks vocabulary chunks with an online logsumexp (running max and rescaled sum), keeping only [N]
running statistics; the backward (`jax.custom_vjp`) recomputes each chunk's logits from the saved logsumexp and
accumulates d hidden and writes d unembed chunk by chunk. Peak extra memory is O(N x chunk) instead of O(N x V).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_NEG = -1e30


def _chunk_logits(h, w_chunk, start, vocab, temperature, softcap):
  """Scaled logits [N, C] of one chunk (columns past the real vocabulary masked), and d logits / d z."""
  z = jnp.dot(h, w_chunk, preferred_element_type=jnp.float32)
  dz = jnp.full_like(z, 1.0 / temperature)
  if softcap is not None:
    t = jnp.tanh(z / softcap)
    z = t * softcap
    dz = dz * (1.0 - t * t)
  logits = z / temperature
  cols = start + jnp.arange(w_chunk.shape[1])
  return jnp.where(cols[None, :] < vocab, logits, _NEG), dz, cols


def _padded(unembed, chunk):
  """[D, V] padded to a whole number of chunks (a copy only when V is not a multiple), chunk count, V."""
  v = unembed.shape[1]
  n = -(-v // chunk)
  return (unembed if n * chunk == v else jnp.pad(unembed, ((0, 0), (0, n * chunk - v)))), n, v


def _forward(h, unembed, targets, temperature, softcap, chunk):
  padded, n_chunks, vocab = _padded(unembed, chunk)
  n_rows = h.shape[0]

  def body(carry, i):
    m, s, sl, tgt = carry
    w = jax.lax.dynamic_slice_in_dim(padded, i * chunk, chunk, axis=1)
    logits, _, cols = _chunk_logits(h, w, i * chunk, vocab, temperature, softcap)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(logits - m_new[:, None])
    s = s * scale + jnp.sum(e, axis=1)
    sl = sl * scale + jnp.sum(e * jnp.where(logits > _NEG / 2, logits, 0.0), axis=1)
    tgt = tgt + jnp.sum(jnp.where(cols[None, :] == targets[:, None], logits, 0.0), axis=1)
    return (m_new, s, sl, tgt), None

  init = (jnp.full((n_rows,), _NEG, jnp.float32), jnp.zeros((n_rows,), jnp.float32),
          jnp.zeros((n_rows,), jnp.float32), jnp.zeros((n_rows,), jnp.float32))
  (m, s, sl, tgt), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
  lse = m + jnp.log(s)
  mean_logit = sl / s  # E_p[logits]
  return tgt - lse, lse - mean_logit, lse, mean_logit


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _token_logprobs(h, unembed, targets, temperature, softcap, chunk):
  logp, entropy, lse, _ = _forward(h, unembed, targets, temperature, softcap, chunk)
  return logp, entropy, lse


def _fwd(h, unembed, targets, temperature, softcap, chunk):
  logp, entropy, lse, mean_logit = _forward(h, unembed, targets, temperature, softcap, chunk)
  return (logp, entropy, lse), (h, unembed, targets, lse, mean_logit)


def _bwd(temperature, softcap, chunk, res, grads):
  h, unembed, targets, lse, mean_logit = res
  g_logp, g_ent, g_lse = grads
  padded, n_chunks, vocab = _padded(unembed, chunk)

  def body(carry, i):
    dh, dw = carry
    w = jax.lax.dynamic_slice_in_dim(padded, i * chunk, chunk, axis=1)
    logits, dz, cols = _chunk_logits(h, w, i * chunk, vocab, temperature, softcap)
    p = jnp.exp(logits - lse[:, None])
    # d logp/dl = 1[target] - p;  d lse/dl = p;  d entropy/dl = -p (l - E_p[l]).
    dl = (g_logp[:, None] * ((cols[None, :] == targets[:, None]).astype(jnp.float32) - p)
          + g_lse[:, None] * p - g_ent[:, None] * p * (logits - mean_logit[:, None]))
    dl = jnp.where(cols[None, :] < vocab, dl, 0.0) * dz
    dh = dh + jnp.dot(dl, w.T.astype(jnp.float32))
    dw = jax.lax.dynamic_update_slice_in_dim(dw, jnp.dot(h.T.astype(jnp.float32), dl), i * chunk, axis=1)
    return (dh, dw), None

  init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(padded.shape, jnp.float32))
  (dh, dw), _ = jax.lax.scan(body, init, jnp.arange(n_chunks))
  return dh.astype(h.dtype), dw[:, :vocab].astype(unembed.dtype), None


_token_logprobs.defvjp(_fwd, _bwd)


def token_logprobs_chunked(hidden_NxD, unembed_DxV, targets_N, *, temperature: float = 1.0,
                           softcap: float | None = None, chunk: int = 4096):
  return _token_logprobs(hidden_NxD, unembed_DxV, targets_N.astype(jnp.int32), float(temperature),
                         None if softcap is None else float(softcap), int(min(chunk, unembed_DxV.shape[1])))
