"""attention: softmax attention with grouped-query heads, packing, causal and sliding-window masks and soft-capping,
with the mask given as per-token segment ids and positions (never as a [T, S] array the caller builds).

A query attends to a key when both carry the same segment id and the key's is not 0 (0 = padding or an empty cache
slot), when the key's position is not after the query's (`causal`), and when it is less than `sliding_window`
positions behind (Mistral / Gemma: kv_pos > q_pos - window, as transformers). Rows with nothing to attend to
(padding queries) give finite values that no valid row reads. `sinks` (gpt-oss): one learned logit per query head
that joins each softmax's denominator as a key with no value, so a query may attend to "nothing" in part.

impl:
- `xla`: the reference: the [B, T, S] mask and [B, N, T, S] fp32 scores materialised.
- `chunked`: flash attention in pure JAX on every backend: an online softmax over key blocks, one query block at a
  time, with a custom backward that recomputes each block from the saved logsumexp (FlashAttention-2, Dao 2023,
  Algorithms 1-2). Memory is linear in T; block pairs that no query-key pair of the batch can use (causality,
  window, segments, judged from per-block ranges of positions and segment ids) are skipped in both passes.
- `splash`: Pallas splash attention on TPU (see `splash.py`), shard_mapped over the batch and head mesh axes.
  Causality and windows over slot indices (self-attention, T == S, positions ignored), a Python int window; no
  sinks.
- `cudnn`: cuDNN's flash attention through `jax.nn.dot_product_attention` on GPU, in bf16 / fp16; causality and
  windows over slot indices (T == S), segments as a boolean mask (cuDNN adds it as a bias), no soft-cap, no sinks.
- `auto`: the best for the target (the platform of the mesh set by `jax.set_mesh`, else the default backend): on
  TPU `splash` and on GPU `cudnn` where they apply, else (and on CPU) `xla` while the score tensor is small (the
  short sequences of the tests and the demo task, where it is fastest), `chunked` from `AUTO_CHUNKED_FROM` keys on.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jalign.kernels.target import static_window, target_platform

IMPLS = ("xla", "chunked", "splash", "cudnn", "auto")
AUTO_CHUNKED_FROM = 512    # keys per row from which `auto` takes `chunked` (faster than `xla` from there on CPU)
BLOCKS = (256, 256)        # (query, key) block of `chunked`: the fastest of 128-1024 on XLA:CPU at T = 512-8192
_MASKED = -1e30            # finite, so the reference's fully masked (padding) rows stay NaN-free


def attention_mask(q_segment_BxT, kv_segment_BxS, q_positions_BxT, kv_positions_BxS, *, causal=True,
                   sliding_window=None) -> jax.Array:
  """Boolean [B, T, S]: which keys each query may attend to (see the module doc). `sliding_window` may be a traced
  scalar (per-layer windows under `lax.scan`); 0 or None = unlimited."""
  same = (q_segment_BxT[:, :, None] == kv_segment_BxS[:, None, :]) & (kv_segment_BxS[:, None, :] != 0)
  behind_BxTxS = q_positions_BxT[:, :, None] - kv_positions_BxS[:, None, :]
  if causal:
    same = same & (behind_BxTxS >= 0)
  if sliding_window is not None:
    same = same & ((sliding_window <= 0) | (behind_BxTxS < sliding_window))
  return same


def softmax(scores, sinks_KxG=None):
  """Softmax over the last axis of fp32 scores [B, K, G, ..., S]; with sinks [K, G] (fp32) each row's denominator
  also holds exp(sink)."""
  if sinks_KxG is None:
    return jax.nn.softmax(scores, axis=-1)
  sink = sinks_KxG.reshape(1, *sinks_KxG.shape, *(1,) * (scores.ndim - 3))
  top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
  e = jnp.exp(scores - top)
  return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))


def gqa_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask_BxTxS, *, scale: float, softcap: float | None,
                  kv_heads_first: bool = False, sinks=None):
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
  sinks_KxG = None if sinks is None else sinks.astype(jnp.float32).reshape(k, n // k)
  probs = softmax(scores, sinks_KxG).astype(v_BxSxKxH.dtype)
  out = jnp.einsum(f"bkgts,{kv}->btkgh", probs, v_BxSxKxH)
  return out.reshape(b, t, n, h)


def attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, *,
              q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              q_positions: jax.Array | None = None, kv_positions: jax.Array | None = None, causal: bool = True,
              sliding_window=None, softcap: float | None = None, scale: float | None = None, impl: str = "auto",
              blocks: tuple[int, int] | None = None, interpret: bool = False, sinks: jax.Array | None = None
              ) -> jax.Array:
  """Attention output [B, T, N, H]. Segment ids default to one segment, positions to 0, 1, ...; `scale` to
  H ** -0.5. `sliding_window`: an int, a traced int scalar, or None (0 = unlimited too). `blocks`: `chunked`'s
  (query, key) block sizes; None = `BLOCKS`. `interpret`: run `splash` in Pallas' interpret mode (any backend;
  slow: a correctness check). `sinks`: [N] logits (see the module doc)."""
  if impl not in IMPLS:
    raise ValueError(f"attention impl {impl!r}; available: {', '.join(IMPLS)}")
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  if k_BxSxKxH.shape != v_BxSxKxH.shape or k_BxSxKxH.shape[0] != B or k_BxSxKxH.shape[3] != H or N % K:
    raise ValueError(f"attention shapes: q {q_BxTxNxH.shape} [B, T, N, H], k {k_BxSxKxH.shape} and v "
                     f"{v_BxSxKxH.shape} [B, S, K, H] with K dividing N")
  ones = lambda n: jnp.ones((B, n), jnp.int32)  # noqa: E731
  steps = lambda n: jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))  # noqa: E731
  q_seg = ones(T) if q_segment_ids is None else q_segment_ids.astype(jnp.int32)
  kv_seg = ones(S) if kv_segment_ids is None else kv_segment_ids.astype(jnp.int32)
  q_pos = steps(T) if q_positions is None else q_positions.astype(jnp.int32)
  kv_pos = steps(S) if kv_positions is None else kv_positions.astype(jnp.int32)
  scale = H ** -0.5 if scale is None else float(scale)
  if impl == "auto":
    platform = target_platform()
    if platform == "tpu" and T == S and static_window(sliding_window) and sinks is None:
      impl = "splash"
    elif (platform == "gpu" and T == S and static_window(sliding_window) and softcap is None and sinks is None
          and q_BxTxNxH.dtype in (jnp.bfloat16, jnp.float16)):
      impl = "cudnn"
    else:
      impl = "chunked" if S >= AUTO_CHUNKED_FROM else "xla"
  if sinks is not None and impl in ("cudnn", "splash"):
    raise ValueError(f"attention impl {impl!r} has no sinks; use 'chunked' or 'xla'")
  if impl == "cudnn":
    if target_platform() != "gpu":
      raise ValueError(f"attention impl 'cudnn' needs a GPU target (this one is {target_platform()}); use 'chunked'")
    return cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg, kv_seg, causal=causal, window=sliding_window,
                           softcap=softcap, scale=scale)
  if impl == "splash":
    if target_platform() != "tpu" and not interpret:
      raise ValueError(f"attention impl 'splash' needs a TPU target (this one is {target_platform()}); use "
                       "'chunked', or interpret=True for a slow correctness run")
    from jalign.kernels.splash import splash_attention
    return splash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg, kv_seg, causal=causal, window=sliding_window,
                            softcap=softcap, scale=scale, interpret=interpret)
  if impl == "xla":
    mask = attention_mask(q_seg, kv_seg, q_pos, kv_pos, causal=causal, sliding_window=sliding_window)
    return gqa_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask, scale=scale, softcap=softcap, sinks=sinks)
  window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
  sinks_KxG = (jnp.zeros((K, N // K), jnp.float32) if sinks is None else
               sinks.astype(jnp.float32).reshape(K, N // K))
  bq, bk = (min(b, n) for b, n in zip(blocks or BLOCKS, (T, S)))
  pad_t, pad_s = -T % bq, -S % bk
  pad = lambda a, n: jnp.pad(a, [(0, 0), (0, n)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731  segment 0: padding
  out = _flash(pad(q_BxTxNxH, pad_t), pad(k_BxSxKxH, pad_s), pad(v_BxSxKxH, pad_s), pad(q_seg, pad_t),
               pad(kv_seg, pad_s), pad(q_pos, pad_t), pad(kv_pos, pad_s), window, sinks_KxG, causal, softcap, scale,
               bq, bk, sinks is not None)
  return out[:, :T]


def cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg_BxT, kv_seg_BxS, *, causal: bool, window, softcap,
                    scale: float, implementation: str = "cudnn"):
  """`jax.nn.dot_product_attention` as the `cudnn` impl calls it (`implementation="xla"` evaluates the same call on
  any backend). Padding gets a segment of its own, so no row is fully masked (cuDNN would give it NaN, and a NaN
  value row poisons every P @ V that reads it, even with weight 0)."""
  t, s = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
  if (softcap is not None or t != s or not static_window(window)
      or (window and not causal)):
    raise ValueError("attention impl 'cudnn' takes self-attention (T == S) without a soft-cap, and a Python int "
                     f"sliding_window only when causal (got T={t}, S={s}, softcap={softcap}, window={window!r}, "
                     f"causal={causal}); use 'chunked'")
  pad = lambda seg: jnp.where(seg == 0, -1, seg)  # noqa: E731
  mask_Bx1xTxS = (pad(q_seg_BxT)[:, :, None] == pad(kv_seg_BxS)[:, None, :])[:, None]
  return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask_Bx1xTxS, scale=scale,
                                      is_causal=causal, local_window_size=(window - 1, 0) if window else None,
                                      implementation=implementation)


# ---- chunked: flash attention in pure JAX ----------------------------------------------------------------------

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


def _forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks_KxG, causal, softcap, scale, bq, bk, has_sinks):
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  live = _live_blocks(q_seg, kv_seg, q_pos, kv_pos, window, causal, bq, bk)
  k_blocks, v_blocks = _split(k, bk), _split(v, bk)
  ks_blocks, kp_blocks = _split(kv_seg, bk), _split(kv_pos, bk)

  def one_query_block(xs):
    i, qb, qs, qp = xs
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

    if has_sinks:  # the sink as a first key with no value: running max at it, sum exp(0) = 1
      init = (jnp.broadcast_to(sinks_KxG[None, :, :, None], (B, K, G, bq)), jnp.ones((B, K, G, bq), jnp.float32),
              jnp.zeros((B, K, G, bq, H), jnp.float32))
    else:
      init = (jnp.full((B, K, G, bq), -jnp.inf, jnp.float32), jnp.zeros((B, K, G, bq), jnp.float32),
              jnp.zeros((B, K, G, bq, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, k_blocks.shape[0], step, init)
    empty = l == 0  # a query with no key to attend to: output 0
    out = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    return jnp.moveaxis(out, 3, 1).reshape(B, bq, N, H).astype(q.dtype), lse

  nq = T // bq
  out, lse = jax.lax.map(one_query_block, (jnp.arange(nq), _split(q, bq), _split(q_seg, bq), _split(q_pos, bq)))
  return _merge(out), lse  # lse: [T/bq, B, K, G, bq]


def _backward(res, d_out):
  q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks_KxG, out, lse, causal, softcap, scale, bq, bk, has_sinks = res
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  G = N // K
  live = _live_blocks(q_seg, kv_seg, q_pos, kv_pos, window, causal, bq, bk)
  # delta_i = sum_h dO_ih O_ih (FlashAttention-2's D), per query block [T/bq, B, K, G, bq].
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, N]
  delta = jnp.moveaxis(_split(delta, bq).reshape(T // bq, B, bq, K, G), 2, -1)
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
    return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

  dq0 = jnp.zeros((T // bq, B, bq, K, G, H), jnp.float32)
  xs = (jnp.arange(S // bk), _split(k, bk), _split(v, bk), _split(kv_seg, bk), _split(kv_pos, bk))
  dq, (dk, dv) = jax.lax.scan(one_key_block, dq0, xs)
  dq = _merge(dq.reshape(T // bq, B, bq, N, H)).astype(q.dtype)
  # A sink takes probability exp(sink - lse) from every key alike: d out / d sink = -p_sink out, so its gradient is
  # -sum over queries of p_sink * delta.
  d_sinks = jnp.zeros_like(sinks_KxG)
  if has_sinks:
    d_sinks = -jnp.sum(jnp.exp(sinks_KxG[None, None, :, :, None] - lse) * delta, axis=(0, 1, 4))
  return dq, _merge(dk), _merge(dv), d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14))
def _flash(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, causal, softcap, scale, bq, bk, has_sinks):
  return _forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, causal, softcap, scale, bq, bk, has_sinks)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, causal, softcap, scale, bq, bk, has_sinks):
  out, lse = _forward(q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, causal, softcap, scale, bq, bk,
                      has_sinks)
  return out, (q, k, v, q_seg, kv_seg, q_pos, kv_pos, window, sinks, out, lse)


def _flash_bwd(causal, softcap, scale, bq, bk, has_sinks, res, d_out):
  dq, dk, dv, d_sinks = _backward((*res, causal, softcap, scale, bq, bk, has_sinks), d_out)
  return dq, dk, dv, None, None, None, None, None, d_sinks


_flash.defvjp(_flash_fwd, _flash_bwd)
