"""attention: softmax attention with grouped-query heads, packing, causal and sliding-window masks and soft-capping,
with the mask given as per-token segment ids and positions (never as a [T, S] array the caller builds).

A query attends to a key when both carry the same segment id and the key's is not 0 (0 = padding or an empty cache
slot), when the key's position is not after the query's (`causal`), and when it is less than `sliding_window`
positions behind (Mistral / Gemma: kv_pos > q_pos - window, as transformers). Rows with nothing to attend to
(padding queries) give finite values that no valid row reads. `sinks` (gpt-oss): one learned logit per query head
that joins each softmax's denominator as a key with no value, so a query may attend to "nothing" in part.

impl:
- `xla`: the reference: the [B, T, S] mask and [B, N, T, S] fp32 scores materialised.
- `chunked`: flash attention in pure JAX on every backend (see `flash.py`): memory linear in T, block pairs the
  mask rules out skipped.
- `splash`: Pallas splash attention on TPU (see `splash.py`), shard_mapped over the batch and head mesh axes.
  Causality and windows over slot indices (self-attention, T == S, positions ignored), a Python int window; no
  sinks.
- `cudnn`: cuDNN's flash attention through `jax.nn.dot_product_attention` on GPU, in bf16 / fp16; causality and
  windows over slot indices (T == S), segments as a boolean mask (cuDNN adds it as a bias), no soft-cap, no sinks.
- On a mesh with a `sequence` axis (context parallelism), self-attention (T == S) by every impl but `xla` runs
  `kernels.context` (ring or all-gather attention over the sequence shards, `chunked` blocks on each device; splash
  blocks inside the ring for `splash`, and `auto` on TPU, where `kernels.ring_splash` applies: causal, tokens in
  `zigzag` order, no window or sinks).
- `auto`: the best for the target (the platform of the mesh set by `jax.set_mesh`, else the default backend): on
  TPU `splash` and on GPU `cudnn` where they apply, else (and on CPU) `xla` while the score tensor is small (the
  short sequences of the tests and the demo task, where it is fastest), `chunked` from `AUTO_CHUNKED_FROM` keys on.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jalign.kernels.context import context_attention
from jalign.kernels.flash import attention_mask, flash
from jalign.kernels.target import sequence_shards, static_window, target_platform

__all__ = ["IMPLS", "attention", "attention_mask", "gqa_attention", "softmax"]

IMPLS = ("xla", "chunked", "splash", "cudnn", "auto")
AUTO_CHUNKED_FROM = 512    # keys per row from which `auto` takes `chunked` (faster than `xla` from there on CPU)
BLOCKS = (256, 256)        # (query, key) block of `chunked`: the fastest of 128-1024 on XLA:CPU at T = 512-8192
_MASKED = -1e30            # finite, so the reference's fully masked (padding) rows stay NaN-free


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
              blocks: tuple[int, int] | None = None, interpret: bool = False, sinks: jax.Array | None = None,
              zigzag: bool = False) -> jax.Array:
  """Attention output [B, T, N, H]. Segment ids default to one segment, positions to 0, 1, ...; `scale` to
  H ** -0.5. `sliding_window`: an int, a traced int scalar, or None (0 = unlimited too). `blocks`: `chunked`'s
  (query, key) block sizes; None = `BLOCKS`. `interpret`: run `splash` in Pallas' interpret mode (any backend;
  slow: a correctness check). `sinks`: [N] logits (see the module doc). `zigzag`: the tokens lie in
  `kernels.zigzag` order over the mesh's sequence shards, each with its slot as its position (the decoder's
  layout there), so splash's static masks can run inside the ring."""
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
  if impl != "xla" and T == S and sequence_shards() > 1:
    return context_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg, kv_seg, q_pos, kv_pos, causal=causal,
                             sliding_window=sliding_window, softcap=softcap, scale=scale, sinks=sinks,
                             blocks=blocks or BLOCKS, zigzag=zigzag, interpret=interpret,
                             splash=impl == "splash" or (impl == "auto" and target_platform() == "tpu"))
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
  out = flash(pad(q_BxTxNxH, pad_t), pad(k_BxSxKxH, pad_s), pad(v_BxSxKxH, pad_s), pad(q_seg, pad_t),
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
