"""Context-parallel attention with Pallas splash blocks (TPU): `kernels.context`'s `ring` and `gather` forms, their
blocks computed by splash's Mosaic kernels instead of `chunked`'s XLA blocks.

Splash builds its masks ahead of time over slot indices, so the layout of the tokens over the shards must be static:
these forms take causal self-attention in `kernels.zigzag` order (shard d holds chunks d and 2P - 1 - d of 2P,
chunks of c tokens, each token's slot increasing along the shard).

`ring`: device d holding the keys of shard j needs one of three masks, none with an empty row:
- j == d (the first step): causal over the shard's own 2c tokens (its two chunks in order);
- j < d: every local query sees the first chunk of j's keys in full, none of its second: a full [2c, c] mask;
- j > d: only the second local chunk's queries see j's keys, all of them: a full [c, 2c] mask.
Each hop's (output, logsumexp) joins the running pair by the log-sum-exp rule (as Liu et al. 2023 merge blocks).
The backward sends the keys round the ring again with their dk, dv accumulators, as `chunked`'s ring does, and runs
splash's own dq and dkv kernels against the global output and logsumexp: p = exp(s - lse) is then each block's
share of the whole softmax, and each block's gradients sum to the full ones. Those kernels are not part of splash's
public API (jax 0.10's `splash_attention_kernel._splash_attention_bwd`), hence jax pinned below 0.11.

`gather`: the keys and values are all-gathered and put back in the tokens' own order; local chunk i (global chunk
d or 2P - 1 - d) attends to them under a causal mask offset by i c: one kernel per chunk, chosen by the device
index among P pairs (`lax.switch`); the backward is splash's own, and dk, dv are reduce-scattered.

Packing and padding are splash's segment ids (padding its own segment, so its rows attend to padding), soft-caps
splash's; sliding windows and sinks take `chunked` blocks (`context_attention` chooses).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels.splash import PAD_SEGMENT
from jalign.kernels.target import ring_hop
from jalign.kernels.zigzag import from_zigzag, to_zigzag

LANES = 128          # splash's blocks are multiples of 128 tokens


def chunk_block(chunk: int) -> int | None:
  """Splash's block for zig-zag chunks of `chunk` tokens: the largest of 512, 256, 128 dividing it (None: none)."""
  return next((b for b in (512, 256, 128) if chunk and chunk % b == 0), None)


@dataclasses.dataclass(frozen=True)
class Static:
  """The static configuration of one call (hashable: a custom_vjp's non-differentiable argument)."""
  axis: str
  shards: int
  form: str  # ring | gather
  softcap: float | None
  scale: float
  block: int
  interpret: bool
  batch: tuple[str, ...] | None
  head: str | None

  def specs(self):
    """shard_map specs of tokens [B, T, N|K, H], rows [B, T] and the logsumexp [B, N, T]."""
    return P(self.batch, self.axis, self.head, None), P(self.batch, self.axis), P(self.batch, self.head, self.axis)


def ring_splash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, q_seg_BxT, kv_seg_BxT, static: Static):
  """Causal self-attention [B, T, N, H] over tokens in `zigzag(T, static.shards)` order split over `static.axis`;
  T / (2 P) a multiple of `static.block`."""
  seg = lambda s: jnp.where(s == 0, PAD_SEGMENT, s).astype(jnp.int32)  # noqa: E731
  return _attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, seg(q_seg_BxT), seg(kv_seg_BxT), static)


def _kernel(mask, heads: int, static: Static):
  """A splash kernel (saving its logsumexp) for one mask shared by `heads` heads."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as masks,
  )
  b = static.block
  sizes = sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                        block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  return sa.make_splash_mha(masks.MultiHeadMask([mask] * heads), block_sizes=sizes,
                            attn_logits_soft_cap=static.softcap, head_shards=1, q_seq_shards=1, save_residuals=True,
                            interpret=static.interpret)


def _kernels(heads: int, chunk: int, static: Static):
  """`ring`'s kernels for the three masks of the module doc: own, earlier, later. `gather`'s: per device index e,
  those of its two chunks (global chunks e and 2P - 1 - e) over all 2 c P keys in order."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as masks,
  )
  if static.form == "gather":
    t, last = 2 * chunk * static.shards, 2 * static.shards - 1
    causal = lambda i: _kernel(masks.CausalMask((chunk, t), offset=i * chunk), heads, static)  # noqa: E731
    return [(causal(e), causal(last - e)) for e in range(static.shards)]
  return tuple(_kernel(m, heads, static) for m in (masks.CausalMask((2 * chunk, 2 * chunk)),
                                                   masks.FullMask((2 * chunk, chunk)),
                                                   masks.FullMask((chunk, 2 * chunk))))


def _heads_first(a):
  return jnp.swapaxes(a, 1, 2)  # [B, T, N, H] <-> [B, N, T, H]


def _forward(kernel, q, k, v, qs, ks):
  """One kernel over rows: (output [B, N, Tq, H] fp32, logsumexp [B, N, Tq])."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  out, (lse,) = jax.vmap(lambda q, k, v, qs, ks: kernel(q, k, v, segment_ids=sa.SegmentIds(qs, ks)))(
      q, k, v, qs, ks)
  return out.astype(jnp.float32), lse.astype(jnp.float32)


def _backward(kernel, q, k, v, qs, ks, out, lse, d_out):
  """Splash's dq, dkv kernels over rows against the global `out`, `lse` (see the module doc)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa
  from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as impl,
  )

  def collapse(info):  # as `_splash_attention` hands mask infos to its kernels
    blocks = info.partial_mask_blocks
    return info if blocks is None else info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))

  kw = kernel.kwargs

  def one(q, k, v, qs, ks, out, lse, d_out):
    res = (q, k, v, sa.SegmentIds(qs, ks), None, out, lse, collapse(kernel.dq_mask_info),
           collapse(kernel.dkv_mask_info))
    grads = impl._splash_attention_bwd(False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None,
                                       kw["mask_function"], kw["attn_logits_soft_cap"], kw["interpret"], res, d_out)
    return grads[3:6]
  return jax.vmap(one)(q, k, v, qs, ks, out.astype(q.dtype), lse, d_out.astype(q.dtype))


def _visit(earlier_fn, later_fn, d, step, static):
  """`earlier_fn()` where shard j = d - step (mod P), whose keys device d holds after `step` hops, precedes d, else
  `later_fn()`."""
  j = (d - step) % static.shards
  return jax.lax.cond(j < d, earlier_fn, later_fn)


def _local_forward(q, k, v, qs, ks, static):
  """One device (tokens as [B, N, 2c, H]): the output and logsumexp of its queries over every shard's keys."""
  c = q.shape[2] // 2
  own, earlier, later = _kernels(q.shape[1], c, static)
  d = jax.lax.axis_index(static.axis)
  hop = ring_hop(static.axis, static.shards)

  def join(s, out, lse, visiting):
    k, v, ks = visiting
    first = lambda: _forward(earlier, q, k[:, :, :c], v[:, :, :c], qs, ks[:, :c])  # noqa: E731

    def second():
      o, l = _forward(later, q[:, :, c:], k, v, qs[:, c:], ks)
      return (jnp.concatenate([jnp.zeros_like(o), o], axis=2),
              jnp.concatenate([jnp.full_like(l, -jnp.inf), l], axis=2))

    o_s, l_s = _visit(first, second, d, s, static)
    top = jnp.logaddexp(lse, l_s)
    return out * jnp.exp(lse - top)[..., None] + o_s * jnp.exp(l_s - top)[..., None], top

  def step(s, carry):
    out, lse, visiting = carry
    arriving = hop(visiting)  # in flight while this shard is computed
    return *join(s, out, lse, visiting), arriving

  out, lse = _forward(own, q, k, v, qs, ks)
  out, lse, last = jax.lax.fori_loop(1, static.shards - 1, step, (out, lse, hop((k, v, ks))))
  return join(static.shards - 1, out, lse, last)


def _gathered(static):
  """All-gather tokens [B, K, 2c, H] or rows [B, 2c] over the sequence axis, back in the tokens' own order."""
  def gather(a):
    axis = 1 if a.ndim == 2 else 2
    return from_zigzag(jax.lax.all_gather(a, static.axis, axis=axis, tiled=True), static.shards, axis)
  return gather


def _gather_forward(q, k, v, qs, ks, static):
  """`gather` on one device: each local chunk over every key (module doc)."""
  c = q.shape[2] // 2
  pairs = _kernels(q.shape[1], c, static)
  k, v, ks = map(_gathered(static), (k, v, ks))

  def pair(kernels):
    def run():
      outs = [_forward(kern, q[:, :, i * c:(i + 1) * c], k, v, qs[:, i * c:(i + 1) * c], ks)
              for i, kern in enumerate(kernels)]
      return tuple(jnp.concatenate(parts, axis=2) for parts in zip(*outs))
    return run
  return jax.lax.switch(jax.lax.axis_index(static.axis), [pair(p) for p in pairs])


def _gather_backward(q, k, v, qs, ks, out, lse, d_out, static):
  """`gather`'s gradients on one device: dq of its queries; dk, dv of every key, summed over the devices and
  scattered back to their shards."""
  c = q.shape[2] // 2
  pairs = _kernels(q.shape[1], c, static)
  k, v, ks = map(_gathered(static), (k, v, ks))

  def pair(kernels):
    def run():
      rows = lambda a, i: a[:, :, i * c:(i + 1) * c]  # noqa: E731
      grads = [_backward(kern, rows(q, i), k, v, qs[:, i * c:(i + 1) * c], ks, rows(out, i), rows(lse, i),
                         rows(d_out, i)) for i, kern in enumerate(kernels)]
      (dq0, dk0, dv0), (dq1, dk1, dv1) = (tuple(g.astype(jnp.float32) for g in gs) for gs in grads)
      return jnp.concatenate([dq0, dq1], axis=2), dk0 + dk1, dv0 + dv1
    return run
  dq, dk, dv = jax.lax.switch(jax.lax.axis_index(static.axis), [pair(p) for p in pairs])
  scatter = lambda a: jax.lax.psum_scatter(to_zigzag(a, static.shards, axis=2), static.axis,  # noqa: E731
                                           scatter_dimension=2, tiled=True)
  return dq, scatter(dk), scatter(dv)


def _local_backward(q, k, v, qs, ks, out, lse, d_out, static):
  """One device: dq of its queries, dk and dv of its own keys (summed over every shard's queries)."""
  c = q.shape[2] // 2
  own, earlier, later = _kernels(q.shape[1], c, static)
  d = jax.lax.axis_index(static.axis)
  hop = ring_hop(static.axis, static.shards)
  f32 = lambda *a: tuple(x.astype(jnp.float32) for x in a)  # noqa: E731

  def grads(s, visiting):
    k, v, ks = visiting

    def first():
      dq_s, dk_s, dv_s = f32(*_backward(earlier, q, k[:, :, :c], v[:, :, :c], qs, ks[:, :c], out, lse, d_out))
      pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=2)  # noqa: E731  the second chunk: no keys seen
      return dq_s, pad(dk_s), pad(dv_s)

    def second():
      dq_s, dk_s, dv_s = f32(*_backward(later, q[:, :, c:], k, v, qs[:, c:], ks, out[:, :, c:], lse[:, :, c:],
                                        d_out[:, :, c:]))
      return jnp.concatenate([jnp.zeros_like(dq_s), dq_s], axis=2), dk_s, dv_s

    return _visit(first, second, d, s, static)

  def step(s, carry):
    dq, visiting, (dk, dv) = carry
    arriving = hop(visiting)
    dq_s, dk_s, dv_s = grads(s, visiting)
    return dq + dq_s, arriving, hop((dk + dk_s, dv + dv_s))

  dq, dk, dv = f32(*_backward(own, q, k, v, qs, ks, out, lse, d_out))
  # the own shard's dk, dv set off round the ring with its keys, gathering each device's share on the way
  dq, last, (dk, dv) = jax.lax.fori_loop(1, static.shards - 1, step, (dq, hop((k, v, ks)), hop((dk, dv))))
  dq_s, dk_s, dv_s = grads(static.shards - 1, last)
  dk, dv = hop((dk + dk_s, dv + dv_s))  # the last hop brings each shard's gradients home
  return dq + dq_s, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, qs, ks, static):
  return _attend_fwd(q, k, v, qs, ks, static)[0]


def _attend_fwd(q, k, v, qs, ks, static):
  tok, row, lse_spec = static.specs()
  scaled = q * jnp.asarray(static.scale, q.dtype)  # splash has no scale argument
  forward = _gather_forward if static.form == "gather" else _local_forward
  out, lse = jax.shard_map(
      lambda q, k, v, qs, ks: forward(_heads_first(q), _heads_first(k), _heads_first(v), qs, ks, static),
      in_specs=(tok, tok, tok, row, row), out_specs=(P(static.batch, static.head, static.axis, None), lse_spec),
      check_vma=False)(scaled, k, v, qs, ks)
  out = _heads_first(out).astype(q.dtype)
  return out, (scaled, k, v, qs, ks, out, lse)


def _attend_bwd(static, res, d_out):
  scaled, k, v, qs, ks, out, lse = res
  tok, row, lse_spec = static.specs()

  backward = _gather_backward if static.form == "gather" else _local_backward

  def local(q, k, v, qs, ks, out, lse, d_out):
    grads = backward(*map(_heads_first, (q, k, v)), qs, ks, _heads_first(out), lse, _heads_first(d_out),
                            static)
    return tuple(_heads_first(g) for g in grads)

  dq, dk, dv = jax.shard_map(local, in_specs=(tok, tok, tok, row, row, tok, lse_spec, tok),
                             out_specs=(tok, tok, tok), check_vma=False)(scaled, k, v, qs, ks, out, lse, d_out)
  dq = dq * static.scale
  return dq.astype(scaled.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attend.defvjp(_attend_fwd, _attend_bwd)
