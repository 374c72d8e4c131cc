"""Mixture-of-Experts feed-forward: each token's top-k experts applied by grouped matmuls, dropless.

The token copies (T tokens x k choices) are sorted by expert, so each expert's rows are contiguous; one grouped
matmul per projection then multiplies each run of rows by its expert's weights (`grouped_matmul`), and the copies are
unsorted and summed with their routing weights. Nothing is dropped and no expert computes a token it was not
chosen for: the work is k / E of the dense all-experts form (`reference`, kept for tests and benchmarks).

`grouped_matmul` impls:
- `auto`: `megablox` when the target (the mesh set by `jax.set_mesh`, else the default backend) is a TPU, else `xla`.
- `xla`: block-sparse in plain XLA: each group's rows padded to whole blocks of `BLOCK` rows, every block multiplied
  by its group's weights (gathered per block) in one batched matmul. The work is the rows' own plus at most a block
  per group.
- `ragged`: `jax.lax.ragged_dot`. XLA's CPU backend expands it to every group over every row (on CPU at 64 experts,
  top 8, 4k tokens: 8.5x slower than the dense all-experts form and 6x its memory; benchmarks/moe.py), so `auto`
  does not pick it.
- `megablox`: the Pallas TPU grouped-matmul kernel (`jax.experimental.pallas.ops.tpu.megablox`), rows padded to its
  tile; `interpret=True` runs it anywhere, slowly, for correctness.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.kernels.target import row_axes, target_platform

IMPLS = ("auto", "xla", "ragged", "megablox")
_TILE = 128  # megablox's row / contraction / output tile
BLOCK = 128  # `xla`: rows per block


def grouped_matmul(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array, *, impl: str = "auto",
                   interpret: bool = False) -> jax.Array:
  """Rows [sum(sizes[:g]), sum(sizes[:g+1])) of `x` times `w[g]`, for each group g: [M, N] in x's dtype (accumulated
  in fp32). Rows past sum(sizes) come back as zeros."""
  if impl not in IMPLS:
    raise ValueError(f"grouped_matmul impl {impl!r}; accepted: {', '.join(IMPLS)}")
  if impl == "auto":
    impl = "megablox" if target_platform() == "tpu" else "xla"
  group_sizes_G = group_sizes_G.astype(jnp.int32)
  if impl == "xla":
    return _blocked(x_MxK, w_GxKxN.astype(x_MxK.dtype), group_sizes_G, BLOCK)
  if impl == "ragged":
    return jax.lax.ragged_dot(x_MxK, w_GxKxN.astype(x_MxK.dtype), group_sizes_G,
                              preferred_element_type=jnp.float32).astype(x_MxK.dtype)
  if target_platform() != "tpu" and not interpret:
    raise ValueError(f"grouped_matmul impl 'megablox' needs a TPU target (this one is {target_platform()}); use "
                     "impl='xla', or interpret=True for a slow correctness run")
  from jax.experimental.pallas.ops.tpu.megablox import (
    gmm,  # local: Mosaic only where it is used
  )

  M, K = x_MxK.shape
  N = w_GxKxN.shape[-1]
  # Mosaic tiles are whole (8, 128) blocks: rows, the contraction and the output padded with zeros to the tile (a
  # LoRA adapter's rank, 16 say, becomes 128: exact, at 128 / rank times the adapter's own small work).
  pad_m, pad_k, pad_n = -M % _TILE, -K % _TILE, -N % _TILE
  x = jnp.pad(x_MxK, ((0, pad_m), (0, pad_k)))
  w = jnp.pad(w_GxKxN.astype(x.dtype), ((0, 0), (0, pad_k), (0, pad_n)))
  y = gmm(x, w, group_sizes_G, jnp.float32, (_TILE, _TILE, _TILE), interpret=interpret)
  return y[:M, :N].astype(x_MxK.dtype)


def _blocked(x_MxK, w_GxKxN, sizes_G, block: int):
  """`grouped_matmul` in blocks: row i of group g goes to padded row pstart[g] + (i - start[g]), where each group
  starts on a block boundary; block j is multiplied by the weights of the group it lies in."""
  M, K = x_MxK.shape
  G, _, N = w_GxKxN.shape
  block = min(block, max(M, 1))
  nb = -(-(M + G * (block - 1)) // block)  # enough blocks for any split of M rows into G groups
  padded_G = -(-sizes_G // block) * block
  end_G, pend_G = jnp.cumsum(sizes_G), jnp.cumsum(padded_G)
  row_M = jnp.arange(M, dtype=jnp.int32)
  group_M = jnp.minimum(jnp.searchsorted(end_G, row_M, side="right"), G - 1)
  real_M = row_M < end_G[-1]
  dest_M = jnp.where(real_M, pend_G[group_M] - padded_G[group_M] + row_M - (end_G[group_M] - sizes_G[group_M]),
                     nb * block)  # rows past the groups go nowhere
  x_padded = jnp.zeros((nb * block, K), x_MxK.dtype).at[dest_M].set(x_MxK, mode="drop")
  group_B = jnp.minimum(jnp.searchsorted(pend_G, jnp.arange(nb, dtype=jnp.int32) * block, side="right"), G - 1)
  y_BxbxN = jnp.einsum("bmk,bkn->bmn", x_padded.reshape(nb, block, K), jnp.take(w_GxKxN, group_B, axis=0),
                       preferred_element_type=jnp.float32)
  y_MxN = jnp.take(y_BxbxN.reshape(nb * block, N), jnp.minimum(dest_M, nb * block - 1), axis=0)
  return jnp.where(real_M[:, None], y_MxN, 0).astype(x_MxK.dtype)


def route(logits_TxE: jax.Array, k: int, *, normalize: bool, score: str = "softmax", bias_E: jax.Array | None = None,
          groups: int = 1, groups_kept: int = 1, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Top-k routing. Returns (gate weights [T, k] fp32, expert ids [T, k] int32).

  `score` "softmax": probabilities over all experts, the k largest kept (Qwen2/3-MoE, Mixtral, transformers 5
  `*TopKRouter`). "sigmoid" (DeepSeek-V3, arXiv:2412.19437 eqs. 13-16; transformers `DeepseekV3TopkRouter`): each
  expert's sigmoid score; experts are chosen by score + `bias_E` (auxiliary-loss-free balancing: the bias steers
  the choice only, never the weights, and gets no gradient), among the `groups_kept` of `groups` equal groups whose
  two best biased scores sum highest. Gates are the scores at the chosen experts, renormalised to sum to 1 when
  `normalize`, times `factor` (`routed_scaling_factor`)."""
  logits = logits_TxE.astype(jnp.float32)
  if score == "softmax":
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
  else:
    scores = jax.nn.sigmoid(logits)
    choice = scores + jax.lax.stop_gradient(bias_E.astype(jnp.float32)) if bias_E is not None else scores
    if groups > 1:
      T, E = choice.shape
      by_group = choice.reshape(T, groups, E // groups)
      group_score = jnp.sum(jax.lax.top_k(by_group, 2)[0], axis=-1)  # [T, groups]
      _, kept = jax.lax.top_k(group_score, groups_kept)
      in_kept = jnp.any(jnp.arange(groups)[None, :, None] == kept[:, None, :], axis=-1)  # [T, groups]
      choice = jnp.where(jnp.repeat(in_kept, E // groups, axis=1), choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
  return _gates(weights, normalize, score, factor), ids.astype(jnp.int32)


def replayed_weights(logits_TxE: jax.Array, ids_TxK: jax.Array, *, normalize: bool, score: str = "softmax",
                     factor: float = 1.0) -> jax.Array:
  """The gate values `route` would give experts `ids` (chosen elsewhere, e.g. by the sampler): the same scores,
  read at those ids, so the router still gets gradients through them."""
  logits = logits_TxE.astype(jnp.float32)
  scores = jax.nn.softmax(logits, axis=-1) if score == "softmax" else jax.nn.sigmoid(logits)
  return _gates(jnp.take_along_axis(scores, ids_TxK, axis=-1), normalize, score, factor)


def _gates(weights_TxK, normalize: bool, score: str, factor: float):
  if normalize:  # DeepSeek-V3 guards the sum of sigmoids (transformers: + 1e-20); a softmax's top k never sum to 0
    weights_TxK = weights_TxK / (jnp.sum(weights_TxK, axis=-1, keepdims=True) + (1e-20 if score == "sigmoid" else 0))
  return weights_TxK * factor if factor != 1.0 else weights_TxK


def gated(activation: Callable) -> Callable:
  """The usual gated MLP's combination of its gate and up projections: act(gate) * up (`experts_mlp`'s `glu`)."""
  return lambda gate, up: activation(gate) * up


def experts_mlp(x_TxD: jax.Array, ids_TxK: jax.Array, weights_TxK: jax.Array, gate_ExDxF: jax.Array,
                up_ExDxF: jax.Array, down_ExFxD: jax.Array, glu: Callable, *, impl: str = "auto",
                adapters: tuple | None = None, adapter_scale: float = 1.0, biases: tuple | None = None,
                adapter_dropout: tuple[float, jax.Array] | None = None) -> jax.Array:
  """sum_j weights[t, j] * down_e(glu(x_t gate_e, x_t up_e)), e = ids[t, j]: [T, D] in x's dtype (`glu`: e.g.
  `gated(jax.nn.silu)`). Dropless: the T*k token copies sorted by expert, three grouped matmuls over them, then
  unsorted.

  `adapters`: per-expert LoRA adapters of gate, up and down, each (A [E, in, r], B [E, r, out]) or None; a
  projection with one computes x W_e + adapter_scale x (x A_e) B_e, two more grouped matmuls of rank r.
  `biases`: per-expert biases of gate, up and down ([E, F], [E, F], [E, D]; gpt-oss), added to each projection's
  output (the down one's weighted like it). `adapter_dropout`: (rate, key): inverted dropout on each adapter's input
  rows, a mask per projection and token copy (PEFT's `lora_dropout` on per-expert modules); under a mesh each device
  folds its index into the key.

  On a mesh (`jax.set_mesh`) it runs under `shard_map`: each device routes its own rows (tokens split over the
  data-parallel axes, `row_axes`), with the experts' hidden dimension split over `tensor` (Megatron-style: the down
  projection's partial sums added over `tensor`) and their model dimension gathered over `fsdp` like a dense layer's.
  With an `expert` axis each device holds E / size(expert) of the experts and its token copies travel to their
  experts' devices and back by all-to-all (`_exchanged`); without one every device has every expert. The Mosaic
  kernel needs the shard_map (it is not partitioned automatically); sorting locally also keeps XLA from gathering
  every token to sort them."""
  mesh = jax.sharding.get_abstract_mesh()
  rate, key = adapter_dropout if adapters is not None and adapter_dropout and adapter_dropout[0] > 0 else (0.0, None)
  mlp = functools.partial(_grouped_mlp, glu=glu, impl=impl, scale=adapter_scale, rate=rate)
  gate_bias, up_bias, down_bias = biases or (None,) * 3
  w = (gate_ExDxF, up_ExDxF, down_ExFxD, gate_bias, up_bias)
  # The down projection's bias outside the experts' matmuls (and the shard_map, whose `tensor` shards each hold a
  # partial sum): sum_j weights[t, j] * bias[ids[t, j]].
  extra = 0 if down_bias is None else jnp.einsum("tkd,tk->td", jnp.take(down_bias, ids_TxK, axis=0).astype(
      x_TxD.dtype), weights_TxK.astype(x_TxD.dtype))
  if mesh.empty or mesh.size == 1:
    return _experts_local(x_TxD, ids_TxK, weights_TxK, w, adapters, functools.partial(mlp, key=key)) + extra
  E, _, F = gate_ExDxF.shape
  tensor = "tensor" if mesh.shape.get("tensor", 1) > 1 and F % mesh.shape["tensor"] == 0 else None
  ep = mesh.shape.get("expert", 1)
  if E % ep:
    raise ValueError(f"{E} experts do not split over the mesh's expert axis of {ep} devices; accepted: an expert "
                     "axis size that divides the expert count")
  expert = "expert" if ep > 1 else None
  row_spec = row_axes(x_TxD.shape[0])
  rows = P(row_spec)

  def local(x, ids, weights, w, a, key):
    if key is not None:  # each device its own masks
      key = jax.random.fold_in(key, jax.lax.axis_index(tuple(mesh.axis_names)))
    if expert is None:
      return _experts_local(x, ids, weights, w, a, functools.partial(mlp, key=key))[None]
    return _exchanged(x, ids, weights, w, a, functools.partial(mlp, key=key), ep)[None]

  # The down projection's input (the hidden dimension) is split over `tensor`: its adapter's A like its weight, B
  # whole (its partial sums add up like the weight's). Gate and up: A whole, B split over their output.
  w_specs = (P(expert, None, tensor), P(expert, None, tensor), P(expert, tensor, None),
             None if gate_bias is None else P(expert, tensor), None if up_bias is None else P(expert, tensor))
  a_specs = None if adapters is None else tuple(
      None if a is None else spec for a, spec in zip(adapters, ((P(expert), P(expert, None, tensor)),) * 2 +
                                                     ((P(expert, tensor, None), P(expert)),)))
  # Each `tensor` shard's partial sums come out stacked and are added outside the shard_map, where the sum's
  # gradient (a broadcast) is XLA's own (Mosaic needs check_vma off, under which a psum would not transpose right).
  partial_SxTxD = jax.shard_map(
      local, in_specs=(rows, rows, rows, w_specs, a_specs, None if key is None else P()),
      out_specs=P(tensor, row_spec), axis_names=set(mesh.axis_names), check_vma=False)(
      x_TxD, ids_TxK, weights_TxK, w, adapters, key)
  return jnp.sum(partial_SxTxD, axis=0) + extra


def _exchanged(x_TxD, ids_TxK, weights_TxK, w, adapters, mlp, ep: int):
  """`_experts_local` with this device's L = E / ep experts (the `expert` axis's shard `me` holds experts
  [me L, (me + 1) L)): every token copy goes to its expert's device in a slot of a [ep, C, D] buffer (C = T k, so
  nothing is ever dropped, whatever the routing), one all-to-all delivers the buffers, each device runs its experts
  over the copies it received, and a second all-to-all returns the results to the slots they came from."""
  T, K = ids_TxK.shape
  L = w[0].shape[0]
  C = T * K
  flat_ids = ids_TxK.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)            # copies grouped by expert, hence by destination device
  dest_C = flat_ids[order] // L
  sent_P = jnp.bincount(dest_C, length=ep)
  slot_C = jnp.arange(C) - (jnp.cumsum(sent_P) - sent_P)[dest_C]
  send_PxCxD = jnp.zeros((ep, C, x_TxD.shape[1]), x_TxD.dtype).at[dest_C, slot_C].set(
      jnp.take(x_TxD, order // K, axis=0))
  send_PxC = jnp.full((ep, C), L, jnp.int32).at[dest_C, slot_C].set(flat_ids[order] % L)  # L: an empty slot
  recv_PxCxD = jax.lax.all_to_all(send_PxCxD, "expert", 0, 0)  # [p] = what device p sent here
  recv_ids = jax.lax.all_to_all(send_PxC, "expert", 0, 0).reshape(-1)
  y_PxCxD = mlp(recv_PxCxD.reshape(ep * C, -1), jnp.arange(ep * C), recv_ids, w, adapters).reshape(ep, C, -1)
  back_PxCxD = jax.lax.all_to_all(y_PxCxD, "expert", 0, 0)    # [p] = results of the copies sent to device p
  y_sorted_CxD = back_PxCxD[dest_C, slot_C]
  y_TxKxD = jnp.take(y_sorted_CxD, jnp.argsort(order), axis=0).reshape(T, K, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(y_TxKxD.dtype))


def _grouped_mlp(x_RxD, row_M, ids_M, w, adapters, *, glu, impl, scale, rate=0.0, key=None):
  """Row `row_M[m]` of x through expert `ids_M[m]`'s MLP, for each m ([M, D]; ids_M = E: none, a zero row). `w`:
  the (gate, up, down) weights and the gate's and up's biases (or None); `adapters`: theirs, their input dropped
  out at `rate` with `key` (`experts_mlp`)."""
  E = w[0].shape[0]
  order = jnp.argsort(ids_M, stable=True)
  sizes_E = jnp.bincount(ids_M, length=E)  # ids == E (none) fall outside: those rows sort last and come back zero
  xs = jnp.take(x_RxD, row_M[order], axis=0)
  adapters = adapters or (None,) * 3

  def proj(x, j):
    y = grouped_matmul(x, w[j], sizes_E, impl=impl)
    if j < 2 and w[3 + j] is not None:
      y = y + jnp.take(w[3 + j], ids_M[order], axis=0, mode="fill", fill_value=0).astype(y.dtype)
    if adapters[j] is None:
      return y
    a, b = adapters[j]
    if key is not None:
      keep = jax.random.bernoulli(jax.random.fold_in(key, j), 1 - rate, x.shape)
      x = jnp.where(keep, x / (1 - rate), 0).astype(x.dtype)
    return y + scale * grouped_matmul(grouped_matmul(x, a, sizes_E, impl=impl), b, sizes_E, impl=impl)

  ys = proj(glu(proj(xs, 0), proj(xs, 1)), 2)
  return jnp.take(ys, jnp.argsort(order), axis=0)


def _experts_local(x_TxD, ids_TxK, weights_TxK, w, adapters, mlp):
  T, K = ids_TxK.shape
  y_TxKxD = mlp(x_TxD, jnp.arange(T * K) // K, ids_TxK.reshape(-1), w, adapters).reshape(T, K, -1)
  return jnp.einsum("tkd,tk->td", y_TxKxD, weights_TxK.astype(y_TxKxD.dtype))


def reference(x_TxD: jax.Array, ids_TxK: jax.Array, weights_TxK: jax.Array, gate_ExDxF: jax.Array,
              up_ExDxF: jax.Array, down_ExFxD: jax.Array, glu: Callable, biases: tuple | None = None) -> jax.Array:
  """`experts_mlp` in the dense all-experts form: every expert on every token, combined by a [T, E] weight matrix
  that is zero off each token's top-k. E / k times the work; the reference for tests and benchmarks."""
  E = gate_ExDxF.shape[0]
  zero = jnp.zeros((E, 1, 1), x_TxD.dtype)
  gb, ub, db = ((zero,) * 3 if biases is None else (b[:, None] for b in biases))
  combine_TxE = jnp.sum(jax.nn.one_hot(ids_TxK, E, dtype=jnp.float32) * weights_TxK[..., None], axis=1)
  h = glu(jnp.einsum("td,edf->etf", x_TxD, gate_ExDxF) + gb, jnp.einsum("td,edf->etf", x_TxD, up_ExDxF) + ub)
  y_ExTxD = jnp.einsum("etf,efd->etd", h, down_ExFxD) + db
  return jnp.einsum("etd,te->td", y_ExTxD, combine_TxE.astype(y_ExTxD.dtype))
