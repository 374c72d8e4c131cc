"""`attention(impl="splash")`: Pallas splash attention on TPU (`jax.experimental.pallas.ops.tpu.splash_attention`),
shard_mapped over the batch ('data', 'fsdp') and head ('tensor') mesh axes, since Mosaic kernels are not
auto-partitioned.

Splash's masks are static over slot indices: causality and windows come from the query's and key's slots (the
decoder's convention for training and scoring, T == S), segments from the segment ids. Padding (segment 0) gets a
segment of its own, so its rows attend to padding (splash rejects rows with nothing to attend to) and no real row
sees it. GQA is native; the scale is applied to q (splash has no scale argument); Gemma 2's soft-cap is its
`attn_logits_soft_cap`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels.target import row_axes, static_window

BLOCK = 512       # query / key block of the forward and both backward kernels (at most; multiples of 128)
PAD_SEGMENT = -1  # padding's own segment id


def _mask(t: int, causal: bool, window: int | None, heads: int):
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as masks,
  )
  if window:  # transformers: kv_slot > q_slot - window
    one = masks.LocalMask((t, t), (window - 1, 0 if causal else None), offset=0)
  elif causal:
    one = masks.CausalMask((t, t))
  else:
    one = masks.FullMask((t, t))
  return masks.MultiHeadMask([one] * heads)


def _local(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, q_seg_BxT, kv_seg_BxT, *, causal, window, softcap, block, interpret):
  """Splash on one shard: [B, T, N, H] -> [B, T, N, H]."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  _, t, n, _ = q_BxTxNxH.shape
  sizes = sa.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                        block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  kernel = sa.make_splash_mha(_mask(t, causal, window, n), block_sizes=sizes, attn_logits_soft_cap=softcap,
                              head_shards=1, q_seq_shards=1, interpret=interpret)
  heads_first = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731  [B, T, N, H] -> [B, N, T, H]
  out = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(qs, ks)))(
      heads_first(q_BxTxNxH), heads_first(k_BxTxKxH), heads_first(v_BxTxKxH), q_seg_BxT, kv_seg_BxT)
  return heads_first(out)


def splash_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, q_seg_BxT, kv_seg_BxS, *, causal: bool, window, softcap,
                     scale: float, interpret: bool = False, block: int = BLOCK):
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  if T != S:
    raise ValueError(f"attention impl 'splash' takes self-attention over one sequence (T == S); got T={T}, S={S}: "
                     "use impl='chunked'")
  if not static_window(window):
    raise ValueError("attention impl 'splash' builds its mask ahead of time and needs a Python int sliding_window; "
                     "got a traced one (per-layer windows under lax.scan: set model.scan_layers=False, or use "
                     "impl='chunked')")
  block = min(block, -(-T // 128) * 128)
  pad = -T % block
  seg = lambda s: jnp.pad(jnp.where(s == 0, PAD_SEGMENT, s), [(0, 0), (0, pad)],  # noqa: E731
                          constant_values=PAD_SEGMENT)
  tokens = lambda a: jnp.pad(a, [(0, 0), (0, pad), (0, 0), (0, 0)])  # noqa: E731
  q = (q_BxTxNxH * jnp.asarray(scale, q_BxTxNxH.dtype))
  local = lambda *a: _local(*a, causal=causal, window=int(window or 0) or None, softcap=softcap,  # noqa: E731
                            block=block, interpret=interpret)
  args = (tokens(q), tokens(k_BxSxKxH), tokens(v_BxSxKxH), seg(q_seg_BxT.astype(jnp.int32)),
          seg(kv_seg_BxS.astype(jnp.int32)))
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(*args)[:, :T]
  batch = row_axes(B)
  t = dict(mesh.shape).get("tensor", 1)
  head = "tensor" if t > 1 and N % t == 0 and K % t == 0 else None
  tok, row = P(batch, None, head, None), P(batch, None)
  out = jax.shard_map(local, in_specs=(tok, tok, tok, row, row), out_specs=tok, check_vma=False)(*args)
  return out[:, :T]
