"""token_logprobs: the one place the LM head meets the loss.

`impl="xla"` is the plain reference: it materialises the [T, V] logits (fine for small vocabularies and tests).
`impl="chunked"` walks the vocabulary in chunks with an online logsumexp and a custom backward, so neither pass holds
more than [T, chunk] logits; it runs on every backend. `impl="pallas_gpu"` / `"pallas_tpu"` are fused kernels that
keep logits tiles on chip (see `pallas.py`). `auto` picks, past `AUTO_XLA_VOCAB`, `pallas_tpu` when
compiling for a TPU (the mesh's devices: compiled for TPU v5e its value+grad temporaries are 1.5% of `xla`'s at
8192 x 2048 x 128256 bf16, `chunked`'s 4.8%; tests/kernels) and `chunked` elsewhere: the GPU kernel stays opt-in
until it has been timed against `chunked` on a chip (`benchmarks/device_check.sh`).

Under a mesh with a `tensor` axis that divides the vocabulary (the training layout shards the unembedding's
vocabulary over it), each shard computes its slice's logsumexp, E_p[logit] and target logit and the shards combine
them (a max and sums), so no device ever holds the whole vocabulary's weights or logits.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jalign.core.sections import bounded
from jalign.kernels.chunked import chunk_columns, token_logprobs_chunked
from jalign.kernels.pallas import TPU_SCOPED_VMEM, token_logprobs_pallas, tpu_vmem_bytes
from jalign.kernels.target import row_axes, target_platform

IMPLS = ("xla", "chunked", "pallas_gpu", "pallas_tpu", "auto")
AUTO_XLA_VOCAB = 4096            # `auto` keeps the plain logits up to this vocabulary
VOCAB_AXIS = "tensor"
_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class LogprobOptions:
  """How objectives compute log-probs (the run config's `logprobs` section): keyword arguments of
  `token_logprobs`."""
  impl: Literal[IMPLS] = "auto"            # auto: xla up to 4096 columns, then pallas_tpu for TPU targets,
                                           # chunked elsewhere
  chunk: int = bounded(0, ge=0)            # vocabulary columns per chunk (`chunked`); 0 = from a 64 MiB budget
  blocks: tuple[int, ...] = ()             # Pallas tile (tokens, vocab, model-dim slice or 0); () = per-chip defaults
  interpret: bool = False                  # run a Pallas kernel in interpret mode (any backend; slow; for checking)

  def kwargs(self) -> dict:
    return dataclasses.asdict(self)


def token_logprobs(hidden_TxD: jax.Array, unembed_DxV: jax.Array, targets_T: jax.Array, *,
                   temperature: float = 1.0, softcap: float | None = None, mask_T: jax.Array | None = None,
                   impl: str = "xla", chunk: int = 0, blocks: tuple[int, ...] = (), interpret: bool = False):
  """(logprobs_T, entropy_T, logsumexp_T) of `targets_T` under softmax(cap(hidden @ unembed) / temperature).

  Leading dims of `hidden`/`targets` beyond T are allowed ([B, T, D] -> [B, T]). Accumulates in fp32. Where
  `mask_T` is 0 the outputs and their gradients are 0 and the target may be anything (e.g. -100 padding)."""
  if impl not in IMPLS:
    raise ValueError(f"token_logprobs impl {impl!r}; available: {', '.join(IMPLS)}")
  if impl in _PLATFORM and not interpret and target_platform() != _PLATFORM[impl]:
    raise ValueError(f"token_logprobs impl {impl!r} needs a {_PLATFORM[impl].upper()} target (this one is "
                     f"{target_platform()}); use impl='chunked', or interpret=True for a slow correctness run")
  if blocks and len(blocks) != 3:
    raise ValueError(f"token_logprobs blocks={tuple(blocks)}: give (tokens, vocab, model-dim slice or 0)")
  lead = targets_T.shape
  hidden = hidden_TxD.reshape(-1, hidden_TxD.shape[-1])  # flat 2-D matmuls: much faster backward on CPU
  targets = targets_T.reshape(-1).astype(jnp.int32)
  vocab = unembed_DxV.shape[1]
  if mask_T is not None:
    keep = mask_T.reshape(-1) != 0
    targets = jnp.where(keep & (targets >= 0) & (targets < vocab), targets, 0)
  if impl == "auto":
    # The TPU kernel where its narrowest blocks fit the default scoped VMEM of every TPU generation (model dims up
    # to ~6k in bf16; wider ones compile with a raised limit on v5e / v5p / v6e, not on v4's 16 MiB).
    fits_vmem = tpu_vmem_bytes(128, 128, hidden.shape[1], hidden.dtype.itemsize) <= TPU_SCOPED_VMEM
    impl = ("xla" if vocab <= AUTO_XLA_VOCAB else
            "pallas_tpu" if target_platform() == "tpu" and fits_vmem else "chunked")
  chunk = chunk or chunk_columns(hidden.shape[0], vocab)
  local = _LOCAL[impl]
  opts = dict(temperature=temperature, softcap=softcap, chunk=chunk, blocks=tuple(blocks) or None,
              interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(mesh.shape)
  shards = sizes.get(VOCAB_AXIS, 1) if vocab % sizes.get(VOCAB_AXIS, 1) == 0 else 1
  if impl in _PLATFORM and sizes:  # Mosaic / Triton kernels are not auto-partitioned: every mesh axis manual
    out = _on_mesh(local, hidden, unembed_DxV, targets, shards, opts, row_axes(hidden.shape[0]),
                   frozenset(mesh.axis_names))
  elif shards > 1:
    out = _on_mesh(local, hidden, unembed_DxV, targets, shards, opts, None, frozenset({VOCAB_AXIS}))
  else:
    out = local(hidden, unembed_DxV, targets, **opts)
  if mask_T is not None:
    out = tuple(jnp.where(keep, x, 0.0) for x in out)
  return tuple(x.reshape(lead) for x in out)


def _xla(hidden, unembed, targets, *, temperature, softcap, **_):
  logits = jnp.dot(hidden, unembed.astype(hidden.dtype), preferred_element_type=jnp.float32)
  if softcap is not None:  # Gemma 2 final-logit soft-capping
    logits = jnp.tanh(logits / softcap) * softcap
  logits = logits / temperature
  lse = jax.nn.logsumexp(logits, axis=-1)
  # Selecting the target through a one-hot product keeps the backward elementwise (a gather's is a scatter); a
  # target outside [0, V) selects nothing (0), which the vocabulary-sharded path relies on.
  onehot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  target_logp = jnp.sum(logits * onehot, axis=-1) - lse
  probs = jnp.exp(logits - lse[:, None])
  entropy = lse - jnp.sum(probs * logits, axis=-1)
  return target_logp, entropy, lse


def _chunked(hidden, unembed, targets, *, temperature, softcap, chunk, **_):
  return token_logprobs_chunked(hidden, unembed, targets, temperature=temperature, softcap=softcap, chunk=chunk)


def _pallas(backend):
  def run(hidden, unembed, targets, *, temperature, softcap, blocks, interpret, **_):
    if interpret is True and backend == "tpu":
      from jax.experimental.pallas import tpu as pltpu
      interpret = pltpu.InterpretParams()  # TPU semantics (grid order, VMEM blocks) rather than generic
    elif interpret:
      interpret = True
    return token_logprobs_pallas(hidden, unembed, targets, backend=backend, temperature=temperature,
                                 softcap=softcap, blocks=blocks, interpret=interpret)
  return run


_LOCAL = {"xla": _xla, "chunked": _chunked, "pallas_gpu": _pallas("gpu"), "pallas_tpu": _pallas("tpu")}


def _on_mesh(local, hidden_NxD, unembed_DxV, targets_N, shards, opts, row_axes, manual):
  """`local` under shard_map over the `manual` mesh axes: rows split over `row_axes` (None: as the caller laid them
  out), the vocabulary over `tensor` when `shards` > 1. Vocabulary shards combine exactly: lse = logsumexp over
  shards of the shard lse; E_p[l] = sum_k exp(lse_k - lse) E_{p_k}[l]; the target logit comes from the one shard
  that holds it."""
  v_local = unembed_DxV.shape[1] // shards
  if opts["interpret"]:  # the TPU-semantics interpreter's callbacks need every mesh axis manual; use the generic one
    opts = {**opts, "interpret": "generic"}

  def per_shard(h, w, y):
    if shards == 1:
      return local(h, w, y, **opts)
    offset = jax.lax.axis_index(VOCAB_AXIS) * v_local
    y_local = jnp.where((y >= offset) & (y < offset + v_local), y - offset, -1)  # -1: not on this shard
    logp_k, entropy_k, lse_k = local(h, w, y_local, **opts)
    target_k = jnp.where(y_local >= 0, logp_k + lse_k, 0.0)
    mean_k = lse_k - entropy_k
    top = jax.lax.pmax(jax.lax.stop_gradient(lse_k), VOCAB_AXIS)  # a shift only: exact with the gradient stopped
    total = jax.lax.psum(jnp.exp(lse_k - top), VOCAB_AXIS)
    lse = top + jnp.log(total)
    mean = jax.lax.psum(jnp.exp(lse_k - lse) * mean_k, VOCAB_AXIS)
    return jax.lax.psum(target_k, VOCAB_AXIS) - lse, lse - mean, lse

  row = P(row_axes)
  vocab = P(None, VOCAB_AXIS if shards > 1 else None)
  return jax.shard_map(per_shard, in_specs=(row, vocab, row), out_specs=(row, row, row), axis_names=set(manual),
                       check_vma=False)(hidden_NxD, unembed_DxV, targets_N)
