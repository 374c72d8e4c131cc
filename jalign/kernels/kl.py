"""Exact per-token divergences between two models' next-token distributions over the whole vocabulary, from both
models' hidden states and unembeddings: KL(pi || pi_ref) for exact-KL regularisation (`full_kl`), and distillation's
generalized Jensen-Shannon divergence between a student p and a frozen teacher q (`full_divergence`; its `beta` as
`jalign.losses.distill` defines it: 0 forward KL(q || p), 1 reverse KL(p || q), between them the JSD of the mixture
m = (1 - beta) p + beta q).

`impl="chunked"` walks the vocabulary in chunks with online logsumexps of both distributions and E_p[z_p - z_q],
E_q[z_q - z_p] (one pass; a second pass over the chunks sums the JSD's terms once both normalisers are known), then
KL(p || q) = E_p[z_p - z_q] - lse_p + lse_q and KL(q || p) alike. The backward recomputes each chunk from the saved
statistics: d/dz_p is p (log p - log q - KL) for the reverse KL, p - q for the forward KL and
(1 - beta) p (log p - log m - KL(p || m)) for the JSD. Neither [T, V] logits tensor is ever held. The reference /
teacher is frozen: gradients flow to the policy's / student's hidden states and unembedding only. The two models may
have different widths (a larger teacher) but share the vocabulary.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels.chunked import (
  _NEG,
  _chunk,
  _chunk_logits,
  chunk_columns,
  n_chunks,
  scan_chunks,
  write_columns,
)
from jalign.kernels.kl_pallas import full_kl_pallas_tpu
from jalign.kernels.target import row_axes, target_platform

IMPLS = ("xla", "chunked", "pallas_tpu", "auto")


def full_kl(hidden_p_TxD: jax.Array, unembed_p_DxV: jax.Array, hidden_q_TxE: jax.Array, unembed_q_ExV: jax.Array, *,
            temperature: float = 1.0, softcap: float | None = None, mask_T: jax.Array | None = None,
            impl: str = "chunked", chunk: int = 0, interpret: bool = False) -> jax.Array:
  """kl_T = KL(softmax(z_p / temp) || softmax(z_q / temp)) per position (0 where `mask_T` is 0); fp32. `chunk`: 0 =
  `chunk_columns`. `impl="auto"`: `pallas_tpu` when compiling for a TPU (the mesh's devices), else `chunked`;
  `interpret` runs the TPU kernel in Pallas' interpret mode on any backend (slow: a correctness check)."""
  return full_divergence(hidden_p_TxD, unembed_p_DxV, hidden_q_TxE, unembed_q_ExV, beta=1.0, temperature=temperature,
                         softcap=softcap, mask_T=mask_T, impl=impl, chunk=chunk, interpret=interpret)


def full_divergence(hidden_p_TxD: jax.Array, unembed_p_DxV: jax.Array, hidden_q_TxE: jax.Array,
                    unembed_q_ExV: jax.Array, *, beta: float, temperature: float = 1.0, softcap: float | None = None,
                    mask_T: jax.Array | None = None, impl: str = "chunked", chunk: int = 0,
                    interpret: bool = False) -> jax.Array:
  """The divergence per position between p = softmax(cap(z_p) / temp) (the policy / student) and q (the frozen
  reference / teacher) by `beta` (the module docstring), 0 where `mask_T` is 0; fp32. `pallas_tpu` computes the
  reverse KL (beta 1) only; `auto` picks it there when compiling for a TPU, else `chunked`."""
  if impl not in IMPLS:
    raise ValueError(f"full_kl impl {impl!r}; available: {', '.join(IMPLS)}")
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"full_divergence: beta={beta} must be in [0, 1] (0 forward KL, 1 reverse KL)")
  if impl == "auto":
    impl = "pallas_tpu" if target_platform() == "tpu" and beta == 1.0 else "chunked"
  if impl == "pallas_tpu" and beta != 1.0:
    raise ValueError(f"full_divergence impl 'pallas_tpu' computes the reverse KL (beta=1) only, not beta={beta}; "
                     "use impl='chunked'")
  if impl == "pallas_tpu" and not interpret and target_platform() != "tpu":
    raise ValueError(f"full_kl impl 'pallas_tpu' needs a TPU target (this one is {target_platform()}); use "
                     "impl='chunked', or interpret=True for a slow correctness run")
  if unembed_p_DxV.shape[1] != unembed_q_ExV.shape[1]:
    raise ValueError(f"full_kl: policy vocabulary {unembed_p_DxV.shape[1]} != reference vocabulary "
                     f"{unembed_q_ExV.shape[1]}")
  lead = hidden_p_TxD.shape[:-1]
  hp = hidden_p_TxD.reshape(-1, hidden_p_TxD.shape[-1])
  hq = jax.lax.stop_gradient(hidden_q_TxE.reshape(-1, hidden_q_TxE.shape[-1]))
  wq = jax.lax.stop_gradient(unembed_q_ExV)
  if impl == "xla":
    div = _xla(hp, unembed_p_DxV, hq, wq, temperature, softcap, float(beta))
  elif impl == "pallas_tpu":
    div = _pallas_tpu(hp, unembed_p_DxV, hq, wq, temperature, softcap, interpret)
  else:
    div = _divergence_chunked(hp, unembed_p_DxV, hq, wq, float(beta), float(temperature),
                              None if softcap is None else float(softcap),
                              int(min(chunk or chunk_columns(hp.shape[0], unembed_p_DxV.shape[1]),
                                      unembed_p_DxV.shape[1])))
  if mask_T is not None:
    div = jnp.where(mask_T.reshape(-1) != 0, div, 0.0)
  return div.reshape(lead)


def log_divergence(log_p: jax.Array, log_q: jax.Array, beta: float) -> jax.Array:
  """The divergence over the last axis between distributions given as log-probabilities (p the student's, q the
  teacher's), by `beta`; the plain form every other one is checked against."""
  if beta == 0.0:
    return _kl(log_q, log_p)
  if beta == 1.0:
    return _kl(log_p, log_q)
  log_m = jnp.logaddexp(log_p + math.log1p(-beta), log_q + math.log(beta))
  return beta * _kl(log_q, log_m) + (1.0 - beta) * _kl(log_p, log_m)


def _kl(log_p: jax.Array, log_q: jax.Array) -> jax.Array:
  """KL(p || q) over the last axis; a token p gives no mass adds 0 (not 0 x inf)."""
  p = jnp.exp(log_p)
  return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def _pallas_tpu(hp, wp, hq, wq, temperature, softcap, interpret):
  """The TPU kernel; under a mesh in shard_map over every axis (Mosaic is not auto-partitioned), rows split over the
  data-parallel axes where they divide, the unembeddings whole."""
  if interpret:
    from jax.experimental.pallas import tpu as pltpu
    interpret = pltpu.InterpretParams()
  run = functools.partial(full_kl_pallas_tpu, temperature=temperature, softcap=softcap, interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return run(hp, wp, hq, wq)
  rows = P(row_axes(hp.shape[0]))
  return jax.shard_map(run, in_specs=(rows, P(), rows, P()), out_specs=rows, check_vma=False)(hp, wp, hq, wq)


def _xla(hp, wp, hq, wq, temperature, softcap, beta):
  def log_softmax(h, w):
    z = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if softcap is not None:
      z = jnp.tanh(z / softcap) * softcap
    return jax.nn.log_softmax(z / temperature, axis=-1)

  return log_divergence(log_softmax(hp, wp), log_softmax(hq, wq), beta)


def _stats(hp, wp, hq, wq, temperature, softcap, chunk):
  """Online (lse_p, lse_q, E_p[z_p - z_q], E_q[z_q - z_p]) over vocabulary chunks."""
  wp, wq = wp.astype(hp.dtype), wq.astype(hq.dtype)
  rows = hp.shape[0]

  def body(carry, ws, i):
    mp, sp, acc_p, mq, sq, acc_q = carry
    wp, wq = ws
    wp_chunk, _, own = _chunk(wp, i, chunk)
    zp, _ = _chunk_logits(hp, wp_chunk, own, temperature, softcap)
    zq, _ = _chunk_logits(hq, _chunk(wq, i, chunk)[0], own, temperature, softcap)
    gap = zp - zq  # columns not owned: both at _NEG, so 0 (and their weights e_p, e_q are 0)
    mp_new = jnp.maximum(mp, jnp.max(zp, axis=1))
    scale = jnp.exp(mp - mp_new)
    ep = jnp.exp(zp - mp_new[:, None])
    sp = sp * scale + jnp.sum(ep, axis=1)
    acc_p = acc_p * scale + jnp.sum(ep * gap, axis=1)
    mq_new = jnp.maximum(mq, jnp.max(zq, axis=1))
    scale = jnp.exp(mq - mq_new)
    eq = jnp.exp(zq - mq_new[:, None])
    sq = sq * scale + jnp.sum(eq, axis=1)
    acc_q = acc_q * scale - jnp.sum(eq * gap, axis=1)
    return mp_new, sp, acc_p, mq_new, sq, acc_q

  neg, zero = jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32)
  mp, sp, acc_p, mq, sq, acc_q = scan_chunks(body, (neg, zero, zero, neg, zero, zero), (wp, wq),
                                             n_chunks(wp.shape[1], chunk))
  return mp + jnp.log(sp), mq + jnp.log(sq), acc_p / sp, acc_q / sq


def _log_probs(hp, wp, hq, wq, i, chunk, temperature, softcap, lse_p, lse_q):
  """Chunk i's (log p, log q, own columns, its [D, chunk] slice of wp and first column, d logits / d z_p)."""
  wp_chunk, start, own = _chunk(wp, i, chunk)
  zp, dz = _chunk_logits(hp, wp_chunk, own, temperature, softcap)
  zq, _ = _chunk_logits(hq, _chunk(wq, i, chunk)[0], own, temperature, softcap)
  return zp - lse_p[:, None], zq - lse_q[:, None], own, wp_chunk, start, dz


def _jsd_terms(hp, wp, hq, wq, beta, temperature, softcap, chunk, lse_p, lse_q):
  """The JSD and KL(p || m) per row: a second pass over the chunks, with both normalisers known."""
  wp, wq = wp.astype(hp.dtype), wq.astype(hq.dtype)
  log_a, log_b = math.log1p(-beta), math.log(beta)

  def body(carry, ws, i):
    jsd, kl_pm = carry
    lp, lq, own, *_ = _log_probs(hp, ws[0], hq, ws[1], i, chunk, temperature, softcap, lse_p, lse_q)
    lm = jnp.logaddexp(lp + log_a, lq + log_b)
    term_p = jnp.where(own[None, :], jnp.exp(lp) * (lp - lm), 0.0)
    term_q = jnp.where(own[None, :], jnp.exp(lq) * (lq - lm), 0.0)
    return jsd + jnp.sum(beta * term_q + (1.0 - beta) * term_p, axis=1), kl_pm + jnp.sum(term_p, axis=1)

  zero = jnp.zeros((hp.shape[0],), jnp.float32)
  return scan_chunks(body, (zero, zero), (wp, wq), n_chunks(wp.shape[1], chunk))


def _forward(hp, wp, hq, wq, beta, temperature, softcap, chunk):
  """(divergence, what the backward needs: the normalisers and the per-row statistic its gradient subtracts)."""
  lse_p, lse_q, gap_p, gap_q = _stats(hp, wp, hq, wq, temperature, softcap, chunk)
  if beta == 1.0:
    div = gap_p - lse_p + lse_q
    return div, (lse_p, lse_q, div)
  if beta == 0.0:
    return gap_q - lse_q + lse_p, (lse_p, lse_q, jnp.zeros_like(lse_p))
  jsd, kl_pm = _jsd_terms(hp, wp, hq, wq, beta, temperature, softcap, chunk, lse_p, lse_q)
  return jsd, (lse_p, lse_q, kl_pm)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _divergence_chunked(hp, wp, hq, wq, beta, temperature, softcap, chunk):
  return _forward(hp, wp, hq, wq, beta, temperature, softcap, chunk)[0]


def _fwd(hp, wp, hq, wq, beta, temperature, softcap, chunk):
  div, stats = _forward(hp, wp, hq, wq, beta, temperature, softcap, chunk)
  return div, (hp, wp, hq, wq, *stats)


def _bwd(beta, temperature, softcap, chunk, res, g_div):
  hp, wp, hq, wq, lse_p, lse_q, aux = res
  wp_c, wq_c = wp.astype(hp.dtype), wq.astype(hq.dtype)

  def body(carry, ws, i):
    dh, dw = carry
    lp, lq, own, wp_chunk, start, dz = _log_probs(hp, ws[0], hq, ws[1], i, chunk, temperature, softcap, lse_p, lse_q)
    p = jnp.exp(lp)
    if beta == 1.0:  # d KL(p || q) / d z_p
      dl = p * (lp - lq - aux[:, None])
    elif beta == 0.0:  # d KL(q || p) / d z_p
      dl = p - jnp.exp(lq)
    else:  # the mixture's own terms cancel: only KL(p || m)'s explicit dependence on p is left
      lm = jnp.logaddexp(lp + math.log1p(-beta), lq + math.log(beta))
      dl = (1.0 - beta) * p * (lp - lm - aux[:, None])
    dl = (jnp.where(own[None, :], g_div[:, None] * dl, 0.0) * dz).astype(hp.dtype)
    dh = dh + jax.lax.dot_general(dl, wp_chunk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw_chunk = jax.lax.dot_general(hp, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dh, write_columns(dw, dw_chunk, start)

  init = (jnp.zeros(hp.shape, jnp.float32), jnp.zeros(wp.shape, wp.dtype))
  dh, dw = scan_chunks(body, init, (wp_c, wq_c), n_chunks(wp.shape[1], chunk), reverse=True)
  return dh.astype(hp.dtype), dw, jnp.zeros_like(hq), jnp.zeros_like(wq)


_divergence_chunked.defvjp(_fwd, _bwd)
