"""`attention(impl="chunked")`: flash attention in pure JAX on every backend, and the mask every impl shares.

An online softmax over key blocks, one query block at a time, with a custom backward that recomputes each block from
the saved logsumexp (FlashAttention-2, Dao 2023, Algorithms 1-2). Memory is linear in T; block pairs that no
query-key pair of the batch can use (causality, window, segments, judged from per-block ranges of positions and
segment ids) are skipped in both passes.

Both passes also run piecewise over the keys, for context parallelism (`kernels.context`): `accumulate` continues
each query block's running softmax (max, sum, fp32 output) over one more set of keys and `finish` normalises it;
`backward` over any subset of the keys, given the final output and logsumexp, gives that subset's share of dq and
its keys' dk, dv (the backward is a sum over key blocks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


def attention_mask(q_segment_BxT, kv_segment_BxS, q_positions_BxT, kv_positions_BxS, *, causal=True,
                   sliding_window=None) -> jax.Array:
  """Boolean [B, T, S]: which keys each query may attend to (see `kernels.attn`). `sliding_window` may be a traced
  scalar (per-layer windows under `lax.scan`); 0 or None = unlimited."""
  same = (q_segment_BxT[:, :, None] == kv_segment_BxS[:, None, :]) & (kv_segment_BxS[:, None, :] != 0)
  behind_BxTxS = q_positions_BxT[:, :, None] - kv_positions_BxS[:, None, :]
  if causal:
    same = same & (behind_BxTxS >= 0)
  if sliding_window is not None:
    same = same & ((sliding_window <= 0) | (behind_BxTxS < sliding_window))
  return same


def _ranges(seg_BxL, pos_BxL, block):
  """Per block of each row, over its non-padding tokens: (min, max) segment id and (min, max) position, [B, L/b]."""
  b, n = seg_BxL.shape[0], seg_BxL.shape[1] // block
  real = (seg_BxL != 0).reshape(b, n, block)
  big, small = np.iinfo(np.int32).max, np.iinfo(np.int32).min
  lo = lambda a: jnp.min(jnp.where(real, a.reshape(b, n, block), big), axis=-1)  # noqa: E731
  hi = lambda a: jnp.max(jnp.where(real, a.reshape(b, n, block), small), axis=-1)  # noqa: E731
  return lo(seg_BxL), hi(seg_BxL), lo(pos_BxL), hi(pos_BxL)


def _live_blocks(q_seg, kv_seg, q_pos, kv_pos, window, causal, bq, bk):
  """Bool [T/bq, S/bk]: False where no row of the batch has a query-key pair in that block pair that the mask
  allows. Each test is a necessary condition on the block's ranges, so a live pair is never skipped."""
  qs_lo, qs_hi, qp_lo, qp_hi = (a[:, :, None] for a in _ranges(q_seg, q_pos, bq))
  ks_lo, ks_hi, kp_lo, kp_hi = (a[:, None, :] for a in _ranges(kv_seg, kv_pos, bk))
  live = (qs_lo <= ks_hi) & (ks_lo <= qs_hi)  # segment ranges meet (empty blocks have lo > hi)
  if causal:
    live &= kp_lo <= qp_hi
  live &= (window <= 0) | (qp_lo < kp_hi + window)  # not a subtraction: empty blocks hold int32 extremes
  return jnp.any(live, axis=0)


def _block_mask(qs, ks, qp, kp, window, causal):
  return attention_mask(qs, ks, qp, kp, causal=causal, sliding_window=window)[:, None, None]  # [B, 1, 1, bq, bk]


def _scores(qb_BxQxKxGxH, kb_BxSxKxH, scale, softcap):
  """Block scores [B, K, G, bq, bk] in fp32, soft-capped; also tanh of the cap (for the backward) or None."""
  s = jnp.einsum("bqkgh,bskh->bkgqs", qb_BxQxKxGxH, kb_BxSxKxH, preferred_element_type=jnp.float32) * scale
  if softcap is None:
    return s, None
  t = jnp.tanh(s / softcap)
  return t * softcap, t


def _split(a, block):
  """[B, L, ...] -> [L / block, B, block, ...] (the loop's leading axis)."""
  b, l = a.shape[:2]
  return jnp.moveaxis(a.reshape(b, l // block, block, *a.shape[2:]), 1, 0)


def _merge(a):
  """Inverse of `_split`."""
  n, b, block = a.shape[:3]
  return jnp.moveaxis(a, 0, 1).reshape(b, n * block, *a.shape[3:])


def loop(n: int, body, init):
  """`body(j, carry)` for j < n, as a while loop. Not a `fori_loop` (a scan): in a forward pass that a custom_vjp
  differentiates itself, inside the layers' `lax.scan`, JAX's partial evaluation still linearised such a scan and
  kept each step's block scores and mask for it (all [T/bq, S/bk] blocks of them, 128 GiB at 32k tokens on one
  TPU chip); a while loop it leaves alone."""
  return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])), (jnp.int32(0), init))[1]


def start(q_BxTxNxH, k_heads: int, bq: int, sinks_KxG=None):
  """The running softmax of every query block before any key: (max, sum) [T/bq, B, K, G, bq] and the fp32 output
  [T/bq, B, K, G, bq, H]. A sink is a first key with no value: the running max at it, its exp(0) = 1 in the sum."""
  B, T, N, H = q_BxTxNxH.shape
  shape = (T // bq, B, k_heads, N // k_heads, bq)
  acc = jnp.zeros((*shape, H), jnp.float32)
  if sinks_KxG is None:
    return jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32), acc
  return jnp.broadcast_to(sinks_KxG[None, None, :, :, None], shape), jnp.ones(shape, jnp.float32), acc


def _finish_block(carry, dtype):
  m, l, acc = carry  # [.., B, K, G, bq(, H)]
  empty = l == 0  # a query with no key to attend to: output 0
  out = acc / jnp.where(empty, 1.0, l)[..., None]
  lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
  b, k, g, bq, h = out.shape[-5:]
  return jnp.moveaxis(out, -2, -4).reshape(*out.shape[:-5], b, bq, k * g, h).astype(dtype), lse


def finish(carry, dtype):
  """(output [B, T, N, H] in `dtype`, logsumexp [T/bq, B, K, G, bq]) from the running softmax."""
  out, lse = _finish_block(carry, dtype)
  return _merge(out), lse


def accumulate(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, causal, softcap, scale, bq, bk, carry=None,
               sinks_KxG=None):
  """Each query block's running softmax continued over the keys k, v ([B, S, K, H], S a multiple of bk): the new
  carry; or, with `carry=None`, started here (at the sinks, if any) and finished: (output, logsumexp)."""
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  live = _live_blocks(q_seg, kv_seg, q_pos, kv_pos, window, causal, bq, bk)
  k_blocks, v_blocks = _split(k, bk), _split(v, bk)
  ks_blocks, kp_blocks = _split(kv_seg, bk), _split(kv_pos, bk)
  one_shot = carry is None

  def one_query_block(xs):
    i, qb, qs, qp, c = xs
    qb = qb.reshape(B, bq, K, G, H)

    def step(j, carry):
      def compute(carry):
        m, l, acc = carry
        mask = _block_mask(qs, ks_blocks[j], qp, kp_blocks[j], window, causal)
        s, _ = _scores(qb, k_blocks[j], scale, softcap)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing yet: exp(-inf) = 0, no NaN
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        l = l * rescale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v_blocks[j], preferred_element_type=jnp.float32)
        return m_new, l, acc * rescale[..., None] + pv
      return jax.lax.cond(live[i, j], compute, lambda c: c, carry)

    if one_shot:  # the carry of this block only, never all blocks' fp32 outputs at once
      c = jax.tree.map(lambda a: a[0], start(qb.reshape(B, bq, N, H), K, bq, sinks_KxG))
    c = loop(k_blocks.shape[0], step, c)
    return _finish_block(c, q.dtype) if one_shot else c

  nq = T // bq
  blocks = (jnp.arange(nq), _split(q, bq), _split(q_seg, bq), _split(q_pos, bq))
  if one_shot:
    out, lse = jax.lax.map(lambda xs: one_query_block((*xs, None)), blocks)
    return _merge(out), lse
  return jax.lax.map(one_query_block, (*blocks, carry))


def backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, out, lse, d_out, causal, softcap, scale, bq, bk):
  """The share of the keys k, v in the gradient, given the final `out` and `lse` (over all keys): (dq, dk, dv) in
  fp32, dq [B, T, N, H], dk and dv [B, S, K, H]."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  live = _live_blocks(q_seg, kv_seg, q_pos, kv_pos, window, causal, bq, bk)
  delta = _delta(out, d_out, K, bq)
  q_blocks = _split(q, bq).reshape(T // bq, B, bq, K, G, H)
  do_blocks = _split(d_out, bq).reshape(T // bq, B, bq, K, G, H)
  qs_blocks, qp_blocks = _split(q_seg, bq), _split(q_pos, bq)

  def one_key_block(dq, xs):
    j, kb, vb, ks, kp = xs

    def step(i, carry):
      def compute(carry):
        dk, dv, dq = carry
        qb, dob = q_blocks[i], do_blocks[i]
        mask = _block_mask(qs_blocks[i], ks, qp_blocks[i], kp, window, causal)
        s, tanh = _scores(qb, kb, scale, softcap)
        p = jnp.where(mask, jnp.exp(s - lse[i][..., None]), 0.0)  # [B, K, G, bq, bk]
        dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
        dp = jnp.einsum("bqkgh,bskh->bkgqs", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[i][..., None])
        if tanh is not None:
          ds = ds * (1.0 - tanh * tanh)
        ds = (ds * scale).astype(q.dtype)
        dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds, qb, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bkgqs,bskh->bqkgh", ds, kb, preferred_element_type=jnp.float32)
        dq = jax.lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, axis=0)
        return dk, dv, dq
      return jax.lax.cond(live[i, j], compute, lambda c: c, carry)

    zeros = jnp.zeros((B, bk, K, H), jnp.float32)
    dk, dv, dq = jax.lax.fori_loop(0, T // bq, step, (zeros, zeros, dq))
    return dq, (dk, dv)

  dq0 = jnp.zeros((T // bq, B, bq, K, G, H), jnp.float32)
  xs = (jnp.arange(S // bk), _split(k, bk), _split(v, bk), _split(kv_seg, bk), _split(kv_pos, bk))
  dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, xs)
  return _merge(dq.reshape(T // bq, B, bq, N, H)), _merge(dk), _merge(dv)


def _delta(out, d_out, k_heads, bq):
  """delta_i = sum_h dO_ih O_ih (FlashAttention-2's D), per query block [T/bq, B, K, G, bq]."""
  B, T, N = out.shape[:3]
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  return jnp.moveaxis(_split(delta, bq).reshape(T // bq, B, bq, k_heads, N // k_heads), 2, -1)


def sinks_grad(sinks_KxG, out, lse, d_out, bq):
  """A sink takes probability exp(sink - lse) from every key alike: d out / d sink = -p_sink out, so its gradient
  is -sum over queries of p_sink * delta. [K, G] fp32."""
  delta = _delta(out, d_out, sinks_KxG.shape[0], bq)
  return -jnp.sum(jnp.exp(sinks_KxG[None, None, :, :, None] - lse) * delta, axis=(0, 1, 4))


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14))
def flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks_KxG, causal, softcap, scale, bq, bk, has_sinks):
  """Attention output [B, T, N, H] (T, S multiples of bq, bk; sinks [K, G] fp32, used when `has_sinks`)."""
  return accumulate(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, causal, softcap, scale, bq, bk,
                    sinks_KxG=sinks_KxG if has_sinks else None)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, causal, softcap, scale, bq, bk, has_sinks):
  out, lse = accumulate(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, causal, softcap, scale, bq, bk,
                        sinks_KxG=sinks if has_sinks else None)
  return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, out, lse)


def _flash_bwd(causal, softcap, scale, bq, bk, has_sinks, res, d_out):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, out, lse = res
  dq, dk, dv = backward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, out, lse, d_out, causal, softcap, scale, bq,
                        bk)
  d_sinks = sinks_grad(sinks, out, lse, d_out, bq) if has_sinks else jnp.zeros_like(sinks)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None, None, d_sinks)


flash.defvjp(_flash_fwd, _flash_bwd)
