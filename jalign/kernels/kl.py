"""Exact per-token KL(pi || pi_ref) over the whole vocabulary from both models' hidden states and unembeddings.

For distillation and exact-KL regularisation: KL_t = sum_v p_v (log p_v - log q_v) with p = softmax of the policy's
logits and q of the reference's. `impl="chunked"` walks the vocabulary in chunks with online logsumexps of both
distributions and E_p[z_p - z_q] (one pass), then KL = E_p[z_p - z_q] - lse_p + lse_q; its backward recomputes each
chunk from the saved statistics: d KL / d z_p = p (log p - log q - KL). Neither [T, V] logits tensor is ever held.
The reference is frozen: gradients flow to the policy's hidden states and unembedding only. The two models may
have different widths (a larger teacher) but share the vocabulary.
"""
from __future__ import annotations

import functools

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
  if impl not in IMPLS:
    raise ValueError(f"full_kl impl {impl!r}; available: {', '.join(IMPLS)}")
  if impl == "auto":
    impl = "pallas_tpu" if target_platform() == "tpu" else "chunked"
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
    kl = _xla(hp, unembed_p_DxV, hq, wq, temperature, softcap)
  elif impl == "pallas_tpu":
    kl = _pallas_tpu(hp, unembed_p_DxV, hq, wq, temperature, softcap, interpret)
  else:
    kl = _kl_chunked(hp, unembed_p_DxV, hq, wq, float(temperature), None if softcap is None else float(softcap),
                     int(min(chunk or chunk_columns(hp.shape[0], unembed_p_DxV.shape[1]), unembed_p_DxV.shape[1])))
  if mask_T is not None:
    kl = jnp.where(mask_T.reshape(-1) != 0, kl, 0.0)
  return kl.reshape(lead)


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


def _xla(hp, wp, hq, wq, temperature, softcap):
  def log_softmax(h, w):
    z = jnp.dot(h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if softcap is not None:
      z = jnp.tanh(z / softcap) * softcap
    return jax.nn.log_softmax(z / temperature, axis=-1)

  lp, lq = log_softmax(hp, wp), log_softmax(hq, wq)
  return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def _stats(hp, wp, hq, wq, temperature, softcap, chunk):
  """Online (lse_p, lse_q, E_p[z_p - z_q]) over vocabulary chunks."""
  wp, wq = wp.astype(hp.dtype), wq.astype(hq.dtype)
  rows = hp.shape[0]

  def body(carry, ws, i):
    mp, sp, acc, mq, sq = carry
    wp, wq = ws
    wp_chunk, _, own = _chunk(wp, i, chunk)
    zp, _ = _chunk_logits(hp, wp_chunk, own, temperature, softcap)
    zq, _ = _chunk_logits(hq, _chunk(wq, i, chunk)[0], own, temperature, softcap)
    mp_new = jnp.maximum(mp, jnp.max(zp, axis=1))
    scale = jnp.exp(mp - mp_new)
    ep = jnp.exp(zp - mp_new[:, None])
    sp = sp * scale + jnp.sum(ep, axis=1)
    acc = acc * scale + jnp.sum(ep * (zp - zq), axis=1)  # columns not owned: e_p = 0 and z_p - z_q = 0
    mq_new = jnp.maximum(mq, jnp.max(zq, axis=1))
    sq = sq * jnp.exp(mq - mq_new) + jnp.sum(jnp.exp(zq - mq_new[:, None]), axis=1)
    return mp_new, sp, acc, mq_new, sq

  neg, zero = jnp.full((rows,), _NEG, jnp.float32), jnp.zeros((rows,), jnp.float32)
  mp, sp, acc, mq, sq = scan_chunks(body, (neg, zero, zero, neg, zero), (wp, wq), n_chunks(wp.shape[1], chunk))
  return mp + jnp.log(sp), mq + jnp.log(sq), acc / sp


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _kl_chunked(hp, wp, hq, wq, temperature, softcap, chunk):
  lse_p, lse_q, gap = _stats(hp, wp, hq, wq, temperature, softcap, chunk)
  return gap - lse_p + lse_q


def _fwd(hp, wp, hq, wq, temperature, softcap, chunk):
  lse_p, lse_q, gap = _stats(hp, wp, hq, wq, temperature, softcap, chunk)
  kl = gap - lse_p + lse_q
  return kl, (hp, wp, hq, wq, lse_p, lse_q, kl)


def _bwd(temperature, softcap, chunk, res, g_kl):
  hp, wp, hq, wq, lse_p, lse_q, kl = res
  wp_c, wq_c = wp.astype(hp.dtype), wq.astype(hq.dtype)

  def body(carry, ws, i):
    dh, dw = carry
    wp_c, wq_c = ws
    wp_chunk, start, own = _chunk(wp_c, i, chunk)
    zp, dz = _chunk_logits(hp, wp_chunk, own, temperature, softcap)
    zq, _ = _chunk_logits(hq, _chunk(wq_c, i, chunk)[0], own, temperature, softcap)
    lp, lq = zp - lse_p[:, None], zq - lse_q[:, None]
    dl = g_kl[:, None] * jnp.exp(lp) * (lp - lq - kl[:, None])
    dl = (jnp.where(own[None, :], dl, 0.0) * dz).astype(hp.dtype)
    dh = dh + jax.lax.dot_general(dl, wp_chunk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw_chunk = jax.lax.dot_general(hp, dl, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dh, write_columns(dw, dw_chunk, start)

  init = (jnp.zeros(hp.shape, jnp.float32), jnp.zeros(wp.shape, wp.dtype))
  dh, dw = scan_chunks(body, init, (wp_c, wq_c), n_chunks(wp.shape[1], chunk), reverse=True)
  return dh.astype(hp.dtype), dw, jnp.zeros_like(hq), jnp.zeros_like(wq)


_kl_chunked.defvjp(_fwd, _bwd)
