"""Chunked log-prob / entropy / logsumexp over the vocabulary: never materialises [tokens, vocab] logits.

The forward walks vocabulary chunks with an online logsumexp (running max and rescaled sum), keeping only [N]
running statistics; the backward (`jax.custom_vjp`) recomputes each chunk's logits from the saved logsumexp,
accumulates d hidden in fp32 and writes each chunk's columns of d unembed once, in the unembedding's dtype. Peak
extra memory is O(N x chunk) plus d hidden, instead of O(N x V).

A vocabulary that is not a multiple of the chunk is not padded (that would copy the unembedding): the last chunk is
slid back to end at V and the columns it shares with the previous chunk are masked. Cotangents that are symbolically
zero (e.g. nobody differentiates the entropy) skip their terms.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

_NEG = -1e30
CHUNK_BUDGET_BYTES = 64 << 20  # the fp32 [tokens, chunk] logits of one chunk stay within this...
CHUNK_VOCAB_FRACTION = 64      # ... and a chunk is at most 1/64 of the vocabulary: the passes' memory is ~2 chunk / V
                               # of the plain logits' (a fixed 4096 columns was 10.9% at T=2048, V=50257)


def chunk_columns(tokens: int, vocab: int) -> int:
  """`chunked`'s columns per chunk from the memory budget: a multiple of 128, at least 128, at most the vocabulary."""
  columns = min(CHUNK_BUDGET_BYTES // (4 * max(tokens, 1)), vocab // CHUNK_VOCAB_FRACTION) // 128 * 128
  return min(max(columns, 128), vocab)


def _chunk(w, i, chunk):
  """Chunk i of the columns of `w`: (slice [D, chunk], first column, mask of the columns that belong to chunk i)."""
  start = jnp.minimum(i * chunk, w.shape[1] - chunk)
  cols = start + jnp.arange(chunk)
  return jax.lax.dynamic_slice_in_dim(w, start, chunk, axis=1), start, cols >= i * chunk


def scan_chunks(body, init, weights, n: int, reverse: bool = False):
  """`carry = body(carry, weights, i)` for i < n, with `weights` threaded through the loop behind an optimisation
  barrier: left loop-invariant, XLA on CPU hoists an fp32 copy of a bf16 [D, V] matrix out of the loop (it computes
  bf16 dots in fp32), a V-sized buffer this module exists to avoid."""
  def step(c, i):
    carry, ws = c
    ws = jax.lax.optimization_barrier(ws)
    return (body(carry, ws, i), ws), None

  (carry, _), _ = jax.lax.scan(step, (init, weights), jnp.arange(n), reverse=reverse)
  return carry


def _chunk_logits(h, w_chunk, own, temperature, softcap):
  """Scaled logits [N, C] of one chunk (columns not owned by it at -inf) and d logits / d z."""
  z = jnp.dot(h, w_chunk, preferred_element_type=jnp.float32)
  dz = jnp.full_like(z, 1.0 / temperature)
  if softcap is not None:
    t = jnp.tanh(z / softcap)
    z = t * softcap
    dz = dz * (1.0 - t * t)
  return jnp.where(own[None, :], z / temperature, _NEG), dz


def write_columns(buf, cols_f32, start):
  """`buf` with the [D, chunk] block at `start` set to `cols_f32` (in `buf`'s dtype). A plain update, no select:
  XLA keeps it in place, so the loop's buffer becomes the gradient itself. The columns the slid last chunk does not
  own are written as zeros and then overwritten by their own chunk, so chunks must be visited last to first."""
  return jax.lax.dynamic_update_slice_in_dim(buf, cols_f32.astype(buf.dtype), start, axis=1)


def n_chunks(vocab, chunk):
  return -(-vocab // chunk)


def _forward(h, unembed, targets, temperature, softcap, chunk):
  w = unembed.astype(h.dtype)
  n_rows = h.shape[0]

  def body(carry, w, i):
    m, s, sl, tgt = carry
    w_chunk, start, own = _chunk(w, i, chunk)
    logits, _ = _chunk_logits(h, w_chunk, own, temperature, softcap)
    m_new = jnp.maximum(m, jnp.max(logits, axis=1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(logits - m_new[:, None])
    s = s * scale + jnp.sum(e, axis=1)
    sl = sl * scale + jnp.sum(e * jnp.where(own[None, :], logits, 0.0), axis=1)
    hit = (start + jnp.arange(chunk))[None, :] == targets[:, None]
    tgt = tgt + jnp.sum(jnp.where(hit & own[None, :], logits, 0.0), axis=1)
    return m_new, s, sl, tgt

  zero = jnp.zeros((n_rows,), jnp.float32)
  init = (jnp.full((n_rows,), _NEG, jnp.float32), zero, zero, zero)
  m, s, sl, tgt = scan_chunks(body, init, w, n_chunks(w.shape[1], chunk))
  lse = m + jnp.log(s)
  mean_logit = sl / s  # E_p[logits]
  return tgt - lse, lse - mean_logit, lse, mean_logit


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _token_logprobs(h, unembed, targets, temperature, softcap, chunk):
  logp, entropy, lse, _ = _forward(h, unembed, targets, temperature, softcap, chunk)
  return logp, entropy, lse


def _fwd(h, unembed, targets, temperature, softcap, chunk):
  h, unembed, targets = h.value, unembed.value, targets.value  # symbolic_zeros wraps the primals
  logp, entropy, lse, mean_logit = _forward(h, unembed, targets, temperature, softcap, chunk)
  return (logp, entropy, lse), (h, unembed, targets, lse, mean_logit)


def _bwd(temperature, softcap, chunk, res, grads):
  h, unembed, targets, lse, mean_logit = res
  g_logp, g_ent, g_lse = (None if isinstance(g, SymbolicZero) else g for g in grads)
  w = unembed.astype(h.dtype)

  def body(carry, w, i):
    dh, dw = carry
    w_chunk, start, own = _chunk(w, i, chunk)
    logits, dz = _chunk_logits(h, w_chunk, own, temperature, softcap)
    p = jnp.exp(logits - lse[:, None])
    # d logp/dl = 1[target] - p;  d lse/dl = p;  d entropy/dl = -p (l - E_p[l]).
    dl = jnp.zeros_like(p)
    if g_logp is not None:
      hit = ((start + jnp.arange(chunk))[None, :] == targets[:, None]).astype(jnp.float32)
      dl = dl + g_logp[:, None] * (hit - p)
    if g_lse is not None:
      dl = dl + g_lse[:, None] * p
    if g_ent is not None:
      dl = dl - g_ent[:, None] * p * (logits - mean_logit[:, None])
    dl = (jnp.where(own[None, :], dl, 0.0) * dz).astype(h.dtype)
    dh = dh + jax.lax.dot_general(dl, w_chunk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw_chunk = jax.lax.dot_general(h, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dh, write_columns(dw, dw_chunk, start)

  init = (jnp.zeros(h.shape, jnp.float32), jnp.zeros(unembed.shape, unembed.dtype))
  dh, dw = scan_chunks(body, init, w, n_chunks(w.shape[1], chunk), reverse=True)
  return dh.astype(h.dtype), dw, None


_token_logprobs.defvjp(_fwd, _bwd, symbolic_zeros=True)


def token_logprobs_chunked(hidden_NxD, unembed_DxV, targets_N, *, temperature: float = 1.0,
                           softcap: float | None = None, chunk: int = 4096):
  return _token_logprobs(hidden_NxD, unembed_DxV, targets_N.astype(jnp.int32), float(temperature),
                         None if softcap is None else float(softcap), int(min(chunk, unembed_DxV.shape[1])))
