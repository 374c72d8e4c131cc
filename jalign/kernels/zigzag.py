"""The zig-zag layout of a sequence over P sequence shards (Brandon et al. 2023, "Striped Attention"; the zig-zag
layout of Llama 3 and Megatron's context parallelism): of 2P equal chunks, shard d holds chunks d and 2P - 1 - d, so
under causal attention every shard has as many early as late tokens and the same work."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jalign.kernels.target import sequence_shards


def zigzag(length: int, shards: int) -> np.ndarray:
  """Token order [length] for `shards` sequence shards: shard d takes chunks d and 2 * shards - 1 - d of 2 * shards
  equal chunks (so each holds as many early as late tokens). `x[:, order]` lays a sequence out; `inverse` undoes it."""
  if length % (2 * shards):
    raise ValueError(f"zigzag: the sequence length ({length}) must be a multiple of twice the shards ({shards})")
  chunks = np.arange(length).reshape(2 * shards, -1)
  return np.concatenate([np.concatenate([chunks[d], chunks[2 * shards - 1 - d]]) for d in range(shards)])


def inverse(order: np.ndarray) -> np.ndarray:
  return np.argsort(order)


def balanced_order(length: int) -> bool:
  """Whether a model's tokens go over the current mesh's sequence shards in `zigzag` order: there are shards and
  the length splits into twice as many equal chunks (else the contiguous split, correct but unbalanced)."""
  shards = sequence_shards()
  return shards > 1 and length % (2 * shards) == 0


def to_zigzag(x, shards: int, axis: int = 1):
  """`x` with its `axis` (tokens) in `zigzag(T, shards)` order, by slices, a reversal and a reshape (collective
  permutes over a sharded axis, not a gather of the whole sequence): [.., 2P chunks, ..] -> shard d's chunks d and
  2P - 1 - d side by side."""
  x = jnp.moveaxis(x, axis, 0)
  t = x.shape[0]
  chunks = x.reshape(2 * shards, t // (2 * shards), *x.shape[1:])
  pairs = jnp.stack([chunks[:shards], chunks[shards:][::-1]], axis=1)  # [P, 2, c, ...]
  return jnp.moveaxis(pairs.reshape(x.shape), 0, axis)


def from_zigzag(x, shards: int, axis: int = 1):
  """`to_zigzag` undone."""
  x = jnp.moveaxis(x, axis, 0)
  t = x.shape[0]
  pairs = x.reshape(shards, 2, t // (2 * shards), *x.shape[1:])
  chunks = jnp.concatenate([pairs[:, 0], pairs[::-1, 1]])
  return jnp.moveaxis(chunks.reshape(x.shape), 0, axis)
