"""Decode attention over a packed per-row KV cache: one query per row, row b's keys at cache slots [0, length_b).

The slots of a continuous batch stand at lengths that differ 10-100x. The dense form reads every row's cache up to a
bound common to the batch; the Pallas kernels read each row only up to its own length, so a decode step's cache
traffic is the sum of the lengths rather than rows x the longest. Both kernels are JAX's own paged attention: TPU
(Mosaic) `jax.experimental.pallas.ops.tpu.paged_attention`, GPU (Triton) `jax.experimental.pallas.ops.gpu.
paged_attention`. They take pages [kv_heads, pages, page, head_dim] and skip the pages past each row's length. The
cache [B, K, S, H] is such pages as it lies: each (row, kv head) is one sequence of S / page pages under a single
shared kv head, so it is reshaped, never copied; the query [B, N, H] becomes [B * K, N / K, H] to match.

impl:
- `xla`: the dense form masked by length (and by a sliding window: kv_slot > q_slot - window, as transformers).
- `pallas_tpu`, `pallas_gpu`: the kernels (no sliding window: they mask by length alone; no sinks; on TPU a
  head_dim that is a multiple of 128: Llama 3, Qwen, Mistral, Gemma, not SmolLM2's 64).
- `auto`: the kernel of the target's platform (that of the mesh set by `jax.set_mesh`, else the default backend)
  where it applies (no window, no sinks; a cache of whole pages), else `xla`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels.attn import _MASKED, softmax
from jalign.kernels.target import row_axes, target_platform

DECODE_IMPLS = ("xla", "pallas_tpu", "pallas_gpu", "auto")
PAGE = 128            # the page (a multiple of the TPU's 8 sublanes and of the 16 rows a Triton dot takes)
COMPUTE_BLOCK = 512   # keys per kernel step (pages_per_compute_block x PAGE), at most
# The Triton kernel holds one block of keys and one of values in shared memory. On an H200 a 512-key block at head_dim
# 128 in bf16 asked for 282,624 bytes (2 x 512 x 128 x 2 = 262,144 of them keys and values) where 232,448 (227 KiB,
# Hopper's most per block) are available, and failed to launch: keys and values of a block stay within this budget.
GPU_BLOCK_BYTES = 160 * 1024
TPU_HEAD_DIM = 128    # the TPU kernel's statistics take the head's block shape: it lowers for multiples of 128 only


def _windowed(window) -> bool:
  """Whether a sliding window applies (0 or less is none; a traced one may)."""
  return window is not None and not (isinstance(window, int) and window <= 0)


def decode_impl(impl: str, window, head_dim: int, cache_len: int, sinks: bool = False) -> str:
  """The impl `auto` stands for on the current target (see the module doc)."""
  if impl not in DECODE_IMPLS:
    raise ValueError(f"decode attention impl {impl!r}; available: {', '.join(DECODE_IMPLS)}")
  if impl != "auto":
    return impl
  if _windowed(window) or cache_len % PAGE or sinks:
    return "xla"
  kernel = {"tpu": "pallas_tpu", "gpu": "pallas_gpu"}.get(target_platform(), "xla")
  return "xla" if kernel == "pallas_tpu" and head_dim % TPU_HEAD_DIM else kernel


def decode_attention(q_BxNxH: jax.Array, k_BxKxSxH: jax.Array, v_BxKxSxH: jax.Array, lengths_B: jax.Array, *,
                     scale: float, softcap: float | None = None, window=None, impl: str = "auto",
                     interpret: bool = False, sinks: jax.Array | None = None) -> jax.Array:
  """[B, N, H]: each row's query over its cache's first `lengths_B` slots (the query's own key among them, last).
  Lengths are at least 1. `interpret`: run `pallas_gpu` in Pallas' interpret mode (any backend; slow:
  a correctness check; `pallas_tpu` runs interpreted under `pltpu.force_tpu_interpret_mode()`). `sinks`: [N]
  logits in each softmax's denominator (`kernels.attention`)."""
  B, N, H = q_BxNxH.shape
  _, K, S, _ = k_BxKxSxH.shape
  if k_BxKxSxH.shape != v_BxKxSxH.shape or k_BxKxSxH.shape[0] != B or k_BxKxSxH.shape[3] != H or N % K:
    raise ValueError(f"decode attention shapes: q {q_BxNxH.shape} [B, N, H], k {k_BxKxSxH.shape} and v "
                     f"{v_BxKxSxH.shape} [B, K, S, H] with K dividing N")
  impl = decode_impl(impl, window, H, S, sinks is not None)
  if sinks is not None and impl != "xla":
    raise ValueError(f"decode attention impl {impl!r} has no sinks; use impl='xla'")
  lengths_B = lengths_B.astype(jnp.int32)
  if impl == "xla":
    slot_S = jnp.arange(S, dtype=jnp.int32)
    valid_BxS = slot_S[None] < lengths_B[:, None]
    if window is not None:  # the query stands at slot length - 1
      valid_BxS &= (window <= 0) | (slot_S[None] > lengths_B[:, None] - 1 - window)
    # One query per row: scores [B, K, G, S] without the query-length axis of `gqa_attention`, whose dot XLA:CPU
    # runs 2.3x slower here (measured: 30 layers at 16 x 320 positions, 34 vs 14 ms). Scores and softmax in fp32.
    dt = q_BxNxH.dtype
    q_BxKxGxH = q_BxNxH.reshape(B, K, N // K, H)
    scores = jnp.einsum("bkgh,bksh->bkgs", q_BxKxGxH, k_BxKxSxH.astype(dt), preferred_element_type=jnp.float32)
    scores = scores * scale
    if softcap is not None:  # Gemma 2: tanh soft-capping of the scores, before the mask
      scores = jnp.tanh(scores / softcap) * softcap
    sinks_KxG = None if sinks is None else sinks.astype(jnp.float32).reshape(K, N // K)
    probs = softmax(jnp.where(valid_BxS[:, None, None], scores, _MASKED), sinks_KxG).astype(dt)
    return jnp.einsum("bkgs,bksh->bkgh", probs, v_BxKxSxH.astype(dt)).reshape(B, N, H)
  if _windowed(window):
    raise ValueError(f"decode attention impl {impl!r} masks by length alone; a sliding window ({window}) needs "
                     "impl='xla'")
  if impl == "pallas_tpu" and H % TPU_HEAD_DIM:
    raise ValueError(f"decode attention impl 'pallas_tpu' lowers for head_dim a multiple of {TPU_HEAD_DIM}; this "
                     f"model's is {H}: use impl='xla'")
  if S % PAGE:
    raise ValueError(f"decode attention impl {impl!r} reads the cache in pages of {PAGE} slots; the cache has {S}")
  q = (q_BxNxH * jnp.asarray(scale, q_BxNxH.dtype)).astype(k_BxKxSxH.dtype)  # the kernels take no scale
  local = lambda *a: _paged(*a, impl=impl, softcap=softcap, interpret=interpret)  # noqa: E731
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return local(q, k_BxKxSxH, v_BxKxSxH, lengths_B).astype(q_BxNxH.dtype)
  # Mosaic and Triton kernels are not partitioned by XLA: run one per shard of rows and heads.
  batch = row_axes(B)
  t = dict(mesh.shape).get("tensor", 1)
  head = "tensor" if t > 1 and N % t == 0 and K % t == 0 else None
  qs, cache = P(batch, head, None), P(batch, head, None, None)
  out = jax.shard_map(local, in_specs=(qs, cache, cache, P(batch)), out_specs=qs, check_vma=False)(
      q, k_BxKxSxH, v_BxKxSxH, lengths_B)
  return out.astype(q_BxNxH.dtype)


def _paged(q_BxNxH, k_BxKxSxH, v_BxKxSxH, lengths_B, *, impl: str, softcap, interpret: bool):
  """One shard: the cache as pages of one shared kv head, one sequence per (row, kv head)."""
  B, N, H = q_BxNxH.shape
  _, K, S, _ = k_BxKxSxH.shape
  per_row = S // PAGE
  pages = lambda a: a.reshape(1, B * K * per_row, PAGE, H)  # noqa: E731  free: the cache's own order
  page_indices = jnp.arange(B * K * per_row, dtype=jnp.int32).reshape(B * K, per_row)
  lengths = jnp.repeat(lengths_B, K)
  q = q_BxNxH.reshape(B * K, N // K, H)
  divisor = lambda n, most: max(d for d in range(1, n + 1) if n % d == 0 and d <= most)  # noqa: E731
  if impl == "pallas_tpu":
    block = divisor(per_row, COMPUTE_BLOCK // PAGE)
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
    out = paged_attention(q, pages(k_BxKxSxH), pages(v_BxKxSxH), lengths, page_indices,
                          attn_logits_soft_cap=softcap, pages_per_compute_block=block)
  else:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    splits = divisor(per_row, 16)  # flash-decoding: a row's pages in parallel partitions, combined after
    page_bytes = 2 * PAGE * H * k_BxKxSxH.dtype.itemsize  # one page of keys and one of values
    block = divisor(per_row // splits, max(1, min(COMPUTE_BLOCK // PAGE, GPU_BLOCK_BYTES // page_bytes)))
    out = paged_attention(q, pages(k_BxKxSxH), pages(v_BxKxSxH), page_indices, lengths, k_splits=splits,
                          attn_logits_soft_cap=softcap, pages_per_compute_block=block, interpret=interpret)
  return out.reshape(B, N, H)
