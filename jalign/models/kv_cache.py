"""The decoding cache of the decoder's keys and values."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jalign.models.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  """Preallocated keys/values for decoding, one [B, K, S, H] buffer per layer (so a decode step updates each in
  place; a stacked [L, ...] buffer would be rewritten whole every token). Heads before slots: the layout attention
  reads, so a decode step does not transpose the whole cache (XLA would copy it every token otherwise).
  `segment_BxS` is 0 for empty or padding slots; `index` is the next slot to write: a scalar shared by the batch
  (left-padded prompts keep rows in step), or one per row [B] (`per_row`: rows at different lengths, each writing
  at its own slot, as slots of a continuous batch do). A per-row cache is packed: row b's tokens fill slots
  [0, index_b) with no padding between them, so decoding reads each row by its length alone (segments unread)."""
  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  segment_BxS: jax.Array
  index: jax.Array

  @classmethod
  def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> "KVCache":
    heads, size = cfg.cache_shape
    shape = (batch, heads, max_len, size)
    dtype = dtype or cfg.dtype
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
    return cls(zeros(), zeros(), jnp.zeros((batch, max_len), jnp.int32), jnp.zeros((), jnp.int32))

  def per_row(self) -> "KVCache":
    """The same cache with one write index per row (each at the shared one)."""
    index = jnp.broadcast_to(self.index, self.segment_BxS.shape[:1]) if self.index.ndim == 0 else self.index
    return KVCache(self.k, self.v, self.segment_BxS, index.astype(jnp.int32))

  def repeat(self, n: int) -> "KVCache":
    """Each row's cache n times over (consecutive rows): one prompt's prefix shared by n samples."""
    rep = lambda a: jnp.repeat(a, n, axis=0)  # noqa: E731
    index = self.index if self.index.ndim == 0 else rep(self.index)
    return KVCache(tuple(map(rep, self.k)), tuple(map(rep, self.v)), rep(self.segment_BxS), index)

  def num_bytes(self) -> int:
    return sum(a.size * a.dtype.itemsize for a in (*self.k, *self.v)) + self.segment_BxS.size * 4
