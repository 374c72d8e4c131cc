"""Context parallelism for attention: queries, keys and values split along the sequence over a mesh axis
(`sequence`), each device attending its own queries to every device's keys without ever holding all the scores.

Two forms, both exact (the same online softmax as `chunked`, whose block kernels they run):
- `ring` (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): the key/value shards travel round the
  ring of devices (`ppermute`), one hop per step; each step continues every local query block's running softmax over
  the visiting shard while the next shard is already in flight. The backward sends the shards round again with
  their dk, dv accumulators, which arrive home after the last hop. Memory: two key/value shards per device.
- `gather` (Llama 3, Dubey et al. 2024, section 3.3.2): the keys and values are all-gathered once and the local
  queries attend to all of them; the backward reduce-scatters dk, dv. One collective instead of P - 1 hops, at
  the cost of holding every key and value.
- `auto` picks `gather` when the gathered keys and values take no more memory than the local queries (2 K P <= N:
  grouped-query models on few shards), else `ring`.

Masks are the shared ones (segments, causality by position, windows, soft-caps, sinks), read from each token's
segment id and position, so the kernels do not care how tokens are laid out over the shards. With causal attention
a contiguous split leaves the first shards idle for most of the ring; `kernels.zigzag` orders tokens so that every
shard does the same work. On a TPU, splash's kernels take the blocks' place where their static masks apply
(`kernels.ring_splash`).

Rows are split over the data-parallel axes and heads over `tensor` where they divide, as the other kernels.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels import flash, ring_splash
from jalign.kernels.target import (
  SEQUENCE_AXIS,
  ring_hop,
  row_axes,
  sequence_shards,
  static_window,
)

AXIS = SEQUENCE_AXIS
FORMS = ("ring", "gather", "auto")


def shard_tokens(x_BxTx):
  """`x` [B, T, ...] with its tokens split over the current mesh's `sequence` axis (rows over the data axes): the
  layout a model's activations keep between layers, so each device holds 1 / P of every example's activations and
  remat checkpoints. Unchanged without such an axis or where T does not divide."""
  shards = sequence_shards()
  if shards == 1 or x_BxTx.shape[1] % shards:
    return x_BxTx
  spec = P(row_axes(x_BxTx.shape[0]), AXIS, *(None,) * (x_BxTx.ndim - 2))
  return jax.lax.with_sharding_constraint(x_BxTx, spec)


def pick_form(form: str, shards: int, q_heads: int, kv_heads: int) -> str:
  if form not in FORMS:
    raise ValueError(f"context attention form {form!r}; available: {', '.join(FORMS)}")
  if form != "auto":
    return form
  return "gather" if 2 * kv_heads * shards <= q_heads else "ring"


def context_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, q_seg_BxT, kv_seg_BxT, q_pos_BxT, kv_pos_BxT, *, causal=True,
                      sliding_window=None, softcap: float | None = None, scale: float, sinks=None,
                      form: str = "auto", axis: str = AXIS, blocks: tuple[int, int] = (256, 256),
                      splash: bool = False, zigzag: bool = False, interpret: bool = False):
  """Self-attention [B, T, N, H] with the sequence split over the mesh axis `axis` of the current mesh
  (`jax.set_mesh`). T need not divide evenly: the tail is padded (segment 0) and cut off again. Positions and
  segment ids are those of each token wherever it sits (see `kernels.zigzag`). `sinks`: [N] logits. `splash`: run
  splash's kernels on a TPU target (or in `interpret` mode) where `kernels.ring_splash` applies: causal, no window
  or sinks, tokens in zig-zag order (`zigzag=True`: slots as positions) in chunks of a multiple of 128; elsewhere
  `chunked` blocks."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1 if mesh.empty else dict(mesh.shape).get(axis, 1)
  B, T, N, H = q_BxTxNxH.shape
  K = k_BxTxKxH.shape[2]
  if k_BxTxKxH.shape[1] != T:
    raise ValueError(f"context attention is self-attention: q has {T} tokens, k {k_BxTxKxH.shape[1]}")
  form = pick_form(form, shards, N, K)
  local = -(-T // shards)
  bq, bk = (min(b, local) for b in blocks)
  local = -(-local // max(bq, bk)) * max(bq, bk)
  if local % bq or local % bk:
    raise ValueError(f"context attention blocks {blocks}: one must divide the other")
  pad = lambda a: jnp.pad(a, [(0, 0), (0, local * shards - T)] + [(0, 0)] * (a.ndim - 2))  # noqa: E731
  window = jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32)
  has_sinks = sinks is not None
  sinks_N = jnp.zeros((N,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  args = (pad(q_BxTxNxH), pad(k_BxTxKxH), pad(v_BxTxKxH), *(pad(a.astype(jnp.int32)) for a in
                                                               (q_seg_BxT, kv_seg_BxT, q_pos_BxT, kv_pos_BxT)))
  if mesh.empty or shards == 1:  # nothing to split: the one-device kernel
    out = flash.flash(*args, window, sinks_N.reshape(K, N // K), causal, softcap, float(scale), bq, bk, has_sinks)
    return out[:, :T]
  t = dict(mesh.shape).get("tensor", 1)
  head = "tensor" if t > 1 and N % t == 0 and K % t == 0 else None
  block = ring_splash.chunk_block(T // (2 * shards))
  if (splash and (interpret or mesh.abstract_device.platform == "tpu") and zigzag and causal and not has_sinks
          and static_window(sliding_window) and not sliding_window and T % (2 * shards) == 0 and block):
    static = ring_splash.Static(axis, shards, form, softcap, float(scale), block, interpret, row_axes(B), head)
    return ring_splash.ring_splash(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, q_seg_BxT, kv_seg_BxT, static)
  static = _Static(axis, shards, form, causal, softcap, float(scale), bq, bk, has_sinks, row_axes(B), head)
  return _attend(*args, window, sinks_N, static)[:, :T]


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static configuration of one call (hashable: a custom_vjp's non-differentiable argument)."""
  axis: str
  shards: int
  form: str
  causal: bool
  softcap: float | None
  scale: float
  bq: int
  bk: int
  has_sinks: bool
  batch: tuple[str, ...] | None  # the axes that split rows
  head: str | None               # the axis that splits heads

  def specs(self):
    """shard_map specs of tokens [B, T, N|K, H], rows [B, T], the logsumexp [T/bq, B, K, G, bq] and sinks [N]."""
    return (P(self.batch, self.axis, self.head, None), P(self.batch, self.axis),
            P(self.axis, self.batch, self.head, None, None), P(self.head))


def _local_forward(q, k, v, qs, ks, qp, kp, window, sinks_N, static):
  """One device: (output, logsumexp) of its queries over every shard's keys."""
  kv_heads = k.shape[2]
  sinks = sinks_N.reshape(kv_heads, -1) if static.has_sinks else None
  run = functools.partial(flash.accumulate, causal=static.causal, softcap=static.softcap, scale=static.scale,
                          bq=static.bq, bk=static.bk)
  if static.form == "gather":
    gather = lambda a: jax.lax.all_gather(a, static.axis, axis=1, tiled=True)  # noqa: E731
    return run(q, gather(k), gather(v), qs, gather(ks), qp, gather(kp), window, sinks_KxG=sinks)
  hop = ring_hop(static.axis, static.shards)

  def step(_, c):
    carry, visiting = c
    arriving = hop(visiting)  # in flight while this shard is computed
    carry = run(q, visiting[0], visiting[1], qs, visiting[2], qp, visiting[3], window, carry=carry)
    return carry, arriving

  carry = flash.start(q, kv_heads, static.bq, sinks)
  carry, last = flash.loop(static.shards - 1, step, (carry, (k, v, ks, kp)))
  carry = run(q, last[0], last[1], qs, last[2], qp, last[3], window, carry=carry)
  return flash.finish(carry, q.dtype)


def _local_backward(q, k, v, qs, ks, qp, kp, window, sinks_N, out, lse, d_out, static):
  """One device: dq of its queries, dk and dv of its own keys (summed over every shard's queries), and its share
  of the sinks' gradient."""
  grads = functools.partial(flash.backward, causal=static.causal, softcap=static.softcap, scale=static.scale,
                            bq=static.bq, bk=static.bk)
  if static.form == "gather":
    gather = lambda a: jax.lax.all_gather(a, static.axis, axis=1, tiled=True)  # noqa: E731
    dq, dk, dv = grads(q, gather(k), gather(v), qs, gather(ks), qp, gather(kp), window, out, lse, d_out)
    scatter = lambda a: jax.lax.psum_scatter(a, static.axis, scatter_dimension=1, tiled=True)  # noqa: E731
    dk, dv = scatter(dk), scatter(dv)
  else:
    hop = ring_hop(static.axis, static.shards)

    def step(_, c):
      dq, visiting, dkv = c
      arriving = hop(visiting)
      dq_s, dk_s, dv_s = grads(q, visiting[0], visiting[1], qs, visiting[2], qp, visiting[3], window, out, lse,
                               d_out)
      return dq + dq_s, arriving, hop((dkv[0] + dk_s, dkv[1] + dv_s))

    zeros = jnp.zeros(k.shape, jnp.float32)
    dq, last, dkv = jax.lax.fori_loop(0, static.shards - 1, step,
                                      (jnp.zeros(q.shape, jnp.float32), (k, v, ks, kp), (zeros, zeros)))
    dq_s, dk_s, dv_s = grads(q, last[0], last[1], qs, last[2], qp, last[3], window, out, lse, d_out)
    dq = dq + dq_s
    dk, dv = hop((dkv[0] + dk_s, dkv[1] + dv_s))  # the last hop brings each shard's gradients home
  d_sinks = jnp.zeros_like(sinks_N)
  if static.has_sinks:
    d_sinks = flash.sinks_grad(sinks_N.reshape(k.shape[2], -1), out, lse, d_out, static.bq).reshape(-1)
    d_sinks = jax.lax.psum(d_sinks, (*(static.batch or ()), static.axis))  # every axis that splits queries
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attend(q, k, v, qs, ks, qp, kp, window, sinks_N, static):
  return _attend_fwd(q, k, v, qs, ks, qp, kp, window, sinks_N, static)[0]


def _attend_fwd(q, k, v, qs, ks, qp, kp, window, sinks_N, static):
  tok, row, lse_spec, head = static.specs()
  out, lse = jax.shard_map(functools.partial(_local_forward, static=static),
                           in_specs=(tok, tok, tok, row, row, row, row, P(), head),
                           out_specs=(tok, lse_spec), check_vma=False)(q, k, v, qs, ks, qp, kp, window, sinks_N)
  return out, (q, k, v, qs, ks, qp, kp, window, sinks_N, out, lse)


def _attend_bwd(static, res, d_out):
  tok, row, lse_spec, head = static.specs()
  dq, dk, dv, d_sinks = jax.shard_map(
      functools.partial(_local_backward, static=static),
      in_specs=(tok, tok, tok, row, row, row, row, P(), head, tok, lse_spec, tok),
      out_specs=(tok, tok, tok, head), check_vma=False)(*res, d_out)
  return dq, dk, dv, None, None, None, None, None, d_sinks


_attend.defvjp(_attend_fwd, _attend_bwd)
