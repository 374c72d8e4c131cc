"""Continuous batching over a dense per-layer KV cache of a fixed number of slots.

Responses to RL prompts differ 10-100x in length; a static batch decodes every row until the longest stops. Here a host
loop keeps the slots full instead: a jitted prefill writes new prompts (a whole group: one prompt, its `num_samples`
requests) into free slots, and a jitted decode chunk runs up to `chunk` steps, returning early once a group's worth of
slots has finished, so their requests are collected and the slots refilled. Each slot holds its request packed from
cache slot 0 and writes at its own index (`KVCache.per_row`), so decode attention reads a slot by its length: on
TPU / GPU a Pallas kernel reads each slot only up to its own length (`kernels.decode_attention`); elsewhere the dense
form reads every slot up to the longest active one (rounded up to one of four bounds per doubling, one program each).
A refilled slot's stale entries lie past its length.

Every draw is keyed by (request, step) (`filters.row_keys`), so a request's tokens do not depend on its slot or on
what ran beside it: the static path gives the same samples for the same key.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.kernels.decode import PAGE, decode_impl
from jalign.models.kv_cache import KVCache
from jalign.sampling.filters import row_keys
from jalign.sampling.settings import GenerateOutput, Settings, prompt_bucket

_MIN_KV = 64  # the smallest attention bound compiled


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Slots:
  """The device state of S slots (the cache holds L = longest prompt bucket + max_new positions per slot)."""
  cache: KVCache          # per-row indices [S]
  token_S: jax.Array      # the last token sampled (the next one fed)
  pos_S: jax.Array        # its position
  request_S: jax.Array    # the request a slot serves
  step_S: jax.Array       # tokens generated so far
  budget_S: jax.Array     # the request's token budget
  stopped_S: jax.Array    # emitted a stop token
  running_S: jax.Array    # still generating
  tokens_SxR: jax.Array   # the request's tokens so far (pad after)
  logprobs_SxR: jax.Array
  reads: jax.Array        # [3] float32: decode steps; cache positions read by the dense form (slots x bound) and
                          # by a kernel that reads each slot up to its length (idle slots stand at length 1)
  # `Settings.routes`: the experts of the request's prompt (right-aligned to the longest bucket P, -1 before) and of
  # its response tokens as they are fed back
  prompt_routes_SxPxLxK: jax.Array | None = None
  routes_SxRxLxK: jax.Array | None = None


def run(graphdef, params, prompt_ids, prompt_mask, budgets_N, rng, s: Settings, *, slots: int, chunk: int,
        bucket_min: int, stats: dict | None = None) -> GenerateOutput:
  """Requests n = b * num_samples + i (prompt b's i-th sample), served a group at a time in prompt order.
  `stats`, when given, gets `decode_steps` and the cache positions a step reads on average: `read_bound` (the
  dense form's, every slot to the common bound) and `read_lengths` (a per-slot-length kernel's)."""
  g = s.num_samples
  lengths_B = prompt_mask.sum(1)
  buckets_B = np.asarray([prompt_bucket(int(n), bucket_min) for n in lengths_B])
  lm = nnx.merge(graphdef, params)
  # Where decode attention is a kernel it reads each slot up to its own length, in pages: no common bound needed.
  ragged = decode_impl(lm.cfg.decode_attention, None, lm.cfg.head_dim, PAGE, lm.cfg.attn_sinks) != "xla"
  max_len = int(buckets_B.max()) + s.max_new
  max_len = -(-max_len // PAGE) * PAGE if ragged else max_len
  state = _init(lm.cfg, slots, max_len, int(buckets_B.max()), s)
  prefill, decode = _prefill_program(graphdef, s), _decode_program(graphdef, s)

  n = len(prompt_ids) * g
  out_tokens = np.full((n, s.max_new), s.pad_id, np.int32)
  out_logp = np.zeros((n, s.max_new), np.float32)
  out_len, out_stop = np.zeros(n, np.int32), np.zeros(n, np.int32)
  p_in = prompt_ids.shape[1]
  out_routes = None
  if s.routes:  # [N, P + max_new, L, k], the prompt's columns as given
    out_routes = np.full((n, p_in + s.max_new) + state.routes_SxRxLxK.shape[2:], -1, np.int32)
  queue = list(range(len(prompt_ids)))  # prompts not yet admitted
  free = list(range(slots))
  serving: dict[int, int] = {}  # slot -> request
  while queue or serving:
    admit, queue = queue[:len(free) // g], queue[len(free) // g:]
    if admit:  # one prefill call: the admitted prompts at their longest bucket, a power-of-two batch of them
      bucket = int(buckets_B[admit].max())
      m = 1 << (len(admit) - 1).bit_length()
      ids = np.zeros((m, bucket), np.int32)
      mask = np.zeros((m, bucket), np.int32)
      slot_M = np.full(m * g, slots, np.int32)  # out of range: the padding rows' writes are dropped
      request_M = np.zeros(m * g, np.int32)
      for j, b in enumerate(admit):
        real = prompt_ids[b][prompt_mask[b] == 1]
        ids[j, bucket - len(real):], mask[j, bucket - len(real):] = real, 1
        for i in range(g):
          slot_M[j * g + i] = free.pop(0)
          request_M[j * g + i] = b * g + i
          serving[int(slot_M[j * g + i])] = b * g + i
      ids[len(admit):], mask[len(admit):] = ids[0], mask[0]  # padding rows: a copy of a real prompt
      state = prefill(params, state, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(slot_M),
                      jnp.asarray(request_M), jnp.asarray(budgets_N[request_M]), rng)
    running = np.asarray(state.running_S)
    if running.any():
      longest = int(np.asarray(state.cache.index)[running].max()) + chunk
      kv_len = max_len if ragged else min(max_len, prompt_bucket(longest, _MIN_KV))  # 4 bounds per doubling
      want = g if queue else slots  # return early only when a group could be admitted
      state = decode(params, state, rng, jnp.asarray(want, jnp.int32), kv_len=kv_len, chunk=chunk)
    running = np.asarray(state.running_S)
    finished = [slot for slot in serving if not running[slot]]
    if finished:
      idx = np.asarray(finished)
      rows = [serving.pop(slot) for slot in finished]
      tokens, logp, steps, stopped = jax.device_get((state.tokens_SxR[idx], state.logprobs_SxR[idx],
                                                     state.step_S[idx], state.stopped_S[idx]))
      out_tokens[rows], out_logp[rows] = tokens, logp
      out_len[rows], out_stop[rows] = steps, stopped
      if out_routes is not None:
        prompt, response = jax.device_get((state.prompt_routes_SxPxLxK[idx], state.routes_SxRxLxK[idx]))
        width = min(p_in, prompt.shape[1])
        out_routes[rows, p_in - width:p_in], out_routes[rows, p_in:] = prompt[:, prompt.shape[1] - width:], response
      free.extend(finished)
  if stats is not None:
    steps, bound, lengths = np.asarray(state.reads).tolist()
    stats.update(decode_steps=int(steps), read_bound=bound / max(steps, 1), read_lengths=lengths / max(steps, 1))
  return GenerateOutput(jnp.asarray(out_tokens), jnp.asarray(out_logp), jnp.asarray(out_len), jnp.asarray(out_stop),
                        None if out_routes is None else jnp.asarray(out_routes))


def _init(cfg, slots: int, max_len: int, max_prompt: int, s: Settings) -> Slots:
  zeros = lambda dtype=jnp.int32: jnp.zeros((slots,), dtype)  # noqa: E731
  routes = lambda width: jnp.full((slots, width, len(cfg.moe_layers), cfg.experts_per_token), -1,  # noqa: E731
                                  jnp.int32) if s.routes else None
  return Slots(KVCache.init(cfg, slots, max_len, s.cache_dtype).per_row(), zeros(), zeros(), zeros(), zeros(),
               zeros(), zeros(bool), zeros(bool), jnp.full((slots, s.max_new), s.pad_id, jnp.int32),
               jnp.zeros((slots, s.max_new), jnp.float32), jnp.zeros((3,), jnp.float32), routes(max_prompt),
               routes(s.max_new))


@functools.lru_cache(maxsize=64)
def _prefill_program(graphdef, s: Settings):
  sample = s.sampler()

  @functools.partial(jax.jit, donate_argnums=(1,))
  def prefill(params, state: Slots, ids_MxP, mask_MxP, slot_N, request_N, budget_N, rng) -> Slots:
    """Prompts [M, P] (one bucket) into slots `slot_N` (N = M * num_samples, a group's consecutive): their keys and
    values at cache positions 0..P-1, the rest of each slot's segment row cleared; the first token sampled."""
    lm = nnx.merge(graphdef, params)
    p = ids_MxP.shape[1]
    cache = KVCache.init(lm.cfg, ids_MxP.shape[0], p, s.cache_dtype)
    hidden, cache, routing = lm.forward_routed(ids_MxP, mask_MxP, cache=cache)
    # Packed: each prompt's keys moved to slots 0..len-1 (its left padding rotated past the end), so decoding reads
    # a slot by its length alone.
    len_M = jnp.sum(mask_MxP, axis=1).astype(jnp.int32)
    from_MxP = (jnp.arange(p, dtype=jnp.int32)[None] + (p - len_M)[:, None]) % p
    pack = lambda a: jnp.repeat(jnp.take_along_axis(a, from_MxP[:, None, :, None], axis=2),  # noqa: E731
                                s.num_samples, axis=0)
    put = lambda buffer, rows: buffer.at[slot_N, :, :p].set(pack(rows), mode="drop")  # noqa: E731
    old = state.cache
    len_N = jnp.repeat(len_M, s.num_samples)
    segment = (jnp.arange(old.segment_BxS.shape[1])[None] < len_N[:, None]).astype(jnp.int32)
    new_cache = KVCache(tuple(map(put, old.k, cache.k)), tuple(map(put, old.v, cache.v)),
                        old.segment_BxS.at[slot_N].set(segment, mode="drop"),
                        old.index.at[slot_N].set(len_N, mode="drop"))
    hidden = jnp.repeat(hidden[:, -1], s.num_samples, axis=0)
    token, logp = sample(lm.logits(hidden), row_keys(rng, request_N, jnp.zeros_like(request_N)))
    stopped = s.stops(token)
    set_ = lambda a, v: a.at[slot_N].set(v, mode="drop")  # noqa: E731
    first = lambda fill, v: jnp.full((slot_N.shape[0], s.max_new), fill, v.dtype).at[:, 0].set(v)  # noqa: E731
    return Slots(new_cache, set_(state.token_S, token), set_(state.pos_S, len_N), set_(state.request_S, request_N),
                 set_(state.step_S, jnp.ones_like(request_N)), set_(state.budget_S, budget_N),
                 set_(state.stopped_S, stopped), set_(state.running_S, ~stopped & (budget_N > 1)),
                 set_(state.tokens_SxR, first(s.pad_id, token)), set_(state.logprobs_SxR, first(0.0, logp)),
                 state.reads, *_prompt_routes(state, routing, mask_MxP, slot_N, s.num_samples))

  return prefill


def _prompt_routes(state: Slots, routing, mask_MxP, slot_N, g: int):
  """(prompt routes, response routes) of `state` with slots `slot_N` holding the prefilled prompts' experts
  (right-aligned, -1 on padding) and no response's yet."""
  if state.routes_SxRxLxK is None:
    return None, None
  ids = jnp.where(mask_MxP[None, :, :, None] > 0, routing.ids_BxTxK, -1)  # [L, M, p, k]
  ids = jnp.repeat(jnp.moveaxis(ids, 0, 2), g, axis=0)  # [N, p, L, k]
  width, p = state.prompt_routes_SxPxLxK.shape[1], ids.shape[1]
  rows = jnp.full((ids.shape[0], width) + ids.shape[2:], -1, jnp.int32).at[:, width - p:].set(ids)
  return (state.prompt_routes_SxPxLxK.at[slot_N].set(rows, mode="drop"),
          state.routes_SxRxLxK.at[slot_N].set(-1, mode="drop"))


@functools.lru_cache(maxsize=64)
def _decode_program(graphdef, s: Settings):
  sample = s.sampler()

  @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("kv_len", "chunk"))
  def decode(params, state: Slots, rng, want, *, kv_len: int, chunk: int) -> Slots:
    """Up to `chunk` decode steps of every running slot, over the cache's first `kv_len` positions; stops early once
    `want` slots have finished in this call."""
    lm = nnx.merge(graphdef, params)
    layers = lm.layer_list()
    full = state.cache
    view = KVCache(tuple(k[:, :, :kv_len] for k in full.k), tuple(v[:, :, :kv_len] for v in full.v),
                   full.segment_BxS[:, :kv_len], full.index)
    running_at_start = state.running_S

    def cond(carry):
      i, st = carry
      return (i < chunk) & jnp.any(st.running_S) & (jnp.sum(running_at_start & ~st.running_S) < want)

    def body(carry):
      i, st = carry
      run_ = st.running_S
      hidden, cache, routing = lm.forward_routed(st.token_S[:, None], positions=st.pos_S[:, None], cache=st.cache,
                                                 layers=layers)
      # An idle slot stands at index 0 (its request is collected; it reads and rewrites one stale position).
      cache = dataclasses.replace(cache, index=jnp.where(run_, cache.index, 0))
      read = jnp.stack([1.0, st.cache.index.shape[0] * kv_len, jnp.sum(st.cache.index + 1)])
      new, logp = sample(lm.logits(hidden)[:, 0], row_keys(rng, st.request_S, st.step_S))
      column = jnp.where(run_, st.step_S, s.max_new)  # finished slots write nowhere
      write = lambda buf, v: buf.at[jnp.arange(buf.shape[0]), column].set(v, mode="drop")  # noqa: E731
      step = st.step_S + run_
      stopped = st.stopped_S | (run_ & s.stops(new))
      routes = st.routes_SxRxLxK
      if routes is not None:  # the fed token is response token step - 1
        fed = jnp.where(run_, st.step_S - 1, s.max_new)
        routes = routes.at[jnp.arange(routes.shape[0]), fed].set(jnp.moveaxis(routing.ids_BxTxK[:, :, 0], 0, 1),
                                                                  mode="drop")
      return i + 1, Slots(cache, jnp.where(run_, new, st.token_S), st.pos_S + run_, st.request_S, step,
                          st.budget_S, stopped, run_ & ~stopped & (step < st.budget_S),
                          write(st.tokens_SxR, new), write(st.logprobs_SxR, logp), st.reads + read,
                          st.prompt_routes_SxPxLxK, routes)

    _, st = jax.lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), dataclasses.replace(state, cache=view)))
    put = lambda whole, part: whole.at[:, :, :kv_len].set(part)  # noqa: E731
    cache = KVCache(tuple(map(put, full.k, st.cache.k)), tuple(map(put, full.v, st.cache.v)),
                    full.segment_BxS.at[:, :kv_len].set(st.cache.segment_BxS), st.cache.index)
    return dataclasses.replace(st, cache=cache)

  return decode
