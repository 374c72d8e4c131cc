"""Prefix caching for the continuous-batching engine: the slots' keys and values kept between calls, and which
tokens each slot holds, so a request whose prompt extends a held sequence prefills only the rest.

A multi-turn episode's next prompt is its last prompt, the model's turn and the new observation: the slot that
served the turn still holds all but the turn's last token, so the next call prefills that token and the
observation. The engine reads a held prefix by copying it on the device into the request's slot (or extending it in
place), so a slot is never shared while requests run; between calls a held slot is referenced by the queued
requests whose best prefix it is, and only a slot no queued request references is rewritten while another is free
(least recently used first). Held keys and values belong to the weights that computed them: new weights (or a new
model) drop them all. With recorded routes (MoE routing replay) a slot holds its tokens' experts too, so a request
that reads a held prefix reports the experts that computed the prefix's keys and values.
"""
from __future__ import annotations

import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jalign.models.kv_cache import KVCache


@dataclasses.dataclass
class PrefixCache:
  """Pass one to `sampling.generate(..., prefix_cache=)` (continuous batching) for every call that samples with the
  same weights; it counts `prompt_tokens` (every request's prompt) and `prefill_tokens` (those the prefills ran)."""
  cache: KVCache | None = None
  held: list = dataclasses.field(default_factory=list)   # per slot: the token ids it holds (packed from 0) or None
  routes: list = dataclasses.field(default_factory=list)  # per slot: with recorded routes, the experts of those
                                                          # tokens, [len, L, k] int32 (None otherwise)
  used: list = dataclasses.field(default_factory=list)   # per slot: the call that last wrote it
  calls: int = 0
  weights: tuple = ()  # weak references to the arrays of the weights that computed `cache`
  prompt_tokens: int = 0
  prefill_tokens: int = 0

  def start(self, weights, init, slots: int, max_len: int) -> KVCache:
    """The cache for a call over at least `slots` slots of `max_len` positions: the held one (grown if needed), or
    a new one from `init(slots, max_len)` when there is none or `weights` (the model's arrays) are not the ones
    that computed it."""
    leaves = jax.tree.leaves(weights)
    same = len(leaves) == len(self.weights) and all(r() is x for r, x in zip(self.weights, leaves))
    if self.cache is None or not same:
      self.cache, self.held, self.used = init(slots, max_len), [None] * slots, [0] * slots
      self.routes = [None] * slots
      self.weights = tuple(map(weakref.ref, leaves))
    self.grow(slots, max_len)
    self.calls += 1
    return self.cache

  def grow(self, slots: int, max_len: int) -> None:
    """At least `slots` slots of `max_len` positions, keeping what is held (zeros appended)."""
    c = self.cache
    more, longer = max(slots - c.segment_BxS.shape[0], 0), max(max_len - c.segment_BxS.shape[1], 0)
    if more or longer:
      pad = lambda a: jnp.pad(a, ((0, more), (0, 0), (0, longer), (0, 0)))  # noqa: E731
      self.cache = KVCache(tuple(map(pad, c.k)), tuple(map(pad, c.v)),
                           jnp.pad(c.segment_BxS, ((0, more), (0, longer))), jnp.pad(c.index, (0, more)))
      self.held += [None] * more
      self.routes += [None] * more
      self.used += [0] * more

  def match(self, real: np.ndarray, slots) -> tuple[int, int]:
    """(slot, length) of the longest prefix of `real` that one of `slots` holds; (-1, 0) if none."""
    best = (-1, 0)
    for s in slots:
      held = self.held[s]
      if held is None:
        continue
      n = min(len(held), len(real))
      same = held[:n] == real[:n]
      length = n if same.all() else int(np.argmin(same))
      if length > best[1]:
        best = (s, length)
    return best

  def pick(self, free: set, refs: dict, first: int = -1) -> int:
    """A free slot to write: `first` (a request's own prefix, extended in place) if free, else an empty one, then
    a held one no queued request references, then a referenced one, each least recently used first."""
    if first in free:
      return first
    return min(free, key=lambda s: (self.held[s] is not None, refs.get(s, 0) > 0, self.used[s], s))
