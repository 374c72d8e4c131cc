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
from jalign.sampling.prefix import PrefixCache
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
        bucket_min: int, stats: dict | None = None, prefix: PrefixCache | None = None, weights=()) -> GenerateOutput:
  """Requests n = b * num_samples + i (prompt b's i-th sample), served a group at a time in prompt order.
  `stats`, when given, gets `decode_steps` and the cache positions a step reads on average: `read_bound` (the
  dense form's, every slot to the common bound) and `read_lengths` (a per-slot-length kernel's); and this call's
  prompt tokens of all requests (`prompt_tokens`) against those prefilled (`prefill_tokens`): a group's prompt is
  prefilled once. `prefix` (a `PrefixCache`): the slots are kept for the next call, a prompt that extends a held
  sequence prefills only the rest (its recorded routes: the held prefix's, then the prefill's), and identical
  prompts of a call are prefilled once;
  `weights`: the model's own arrays (before any re-layout for sampling), which the held keys and values belong to."""
  g = s.num_samples
  reals = [np.asarray(ids[m == 1], np.int32) for ids, m in zip(prompt_ids, prompt_mask)]
  widest = prompt_bucket(max(map(len, reals)), bucket_min)
  lm = nnx.merge(graphdef, params)
  # Where decode attention is a kernel it reads each slot up to its own length, in pages: no common bound needed.
  ragged = decode_impl(lm.cfg.decode_attention, None, lm.cfg.cache_shape[1], PAGE, lm.cfg.attn_sinks) != "xla"
  fit = lambda n: -(-n // PAGE) * PAGE if ragged else n  # noqa: E731
  keep = prefix is not None
  prefix = prefix or PrefixCache()
  init = lambda n, length: KVCache.init(lm.cfg, n, length, s.cache_dtype).per_row()  # noqa: E731
  state = _init(lm.cfg, prefix.start(weights, init, slots, fit(widest + s.max_new)), widest, s)
  counted = prefix.prompt_tokens, prefix.prefill_tokens
  slots, max_len = state.cache.segment_BxS.shape
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
  free = set(range(slots))
  # prompt -> the held slot with its longest prefix; held slot -> the queued prompts that want it (its references)
  wants = {b: prefix.match(reals[b], free)[0] for b in queue} if keep else {}
  refs: dict[int, int] = {}
  held_routes: dict[int, np.ndarray] = {}  # request -> the routes of the held prefix it read (recorded routes only)
  for slot in wants.values():
    refs[slot] = refs.get(slot, 0) + 1
  serving: dict[int, int] = {}  # slot -> request
  while queue or serving:
    admit, queue = queue[:len(free) // g], queue[len(free) // g:]
    if admit:
      for b in admit if keep else ():
        refs[wants[b]] -= 1
      state, max_len = _admit(prefill, params, state, prefix, keep, admit, reals, free, refs, serving, budgets_N,
                              rng, s, bucket_min, fit, ragged, held_routes)
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
        for request in rows:  # a held prefix's experts: the prefill ran (and recorded) only the tokens past it
          held = held_routes.pop(request, None)
          if held is not None:
            start = p_in - len(reals[request // g])
            out_routes[request, start:start + len(held)] = held
      for slot, request, t, k in zip(finished, rows, tokens, steps) if keep else ():
        # the slot holds the prompt and every token but the last (sampled, never fed back)
        real = reals[request // g]
        prefix.held[slot] = np.concatenate([real, t[:k - 1]]).astype(np.int32)
        if out_routes is not None:
          prefix.routes[slot] = out_routes[request, p_in - len(real):p_in + k - 1].copy()
      free.update(finished)
  prefix.cache = state.cache
  if stats is not None:
    steps, bound, lengths = np.asarray(state.reads).tolist()
    stats.update(decode_steps=int(steps), read_bound=bound / max(steps, 1), read_lengths=lengths / max(steps, 1),
                 prompt_tokens=prefix.prompt_tokens - counted[0], prefill_tokens=prefix.prefill_tokens - counted[1])
  return GenerateOutput(jnp.asarray(out_tokens), jnp.asarray(out_logp), jnp.asarray(out_len), jnp.asarray(out_stop),
                        None if out_routes is None else jnp.asarray(out_routes))


def _admit(prefill, params, state: Slots, prefix: PrefixCache, keep: bool, admit, reals, free: set, refs: dict,
           serving: dict, budgets_N, rng, s: Settings, bucket_min: int, fit, ragged: bool, held_routes: dict):
  """One prefill call for the admitted prompts' requests (a group each): the rows it runs (the part of each prompt
  past its held prefix; identical prompts once when `keep`), the slots its requests take; with recorded routes,
  `held_routes` gets each request's held prefix's experts. Returns the state and the slots' length (grown when a
  row's prefix and bucket need more)."""
  g = s.num_samples
  rows, row_of, requests = [], {}, []  # rows: (source slot, prefix length, prompt); requests: (row, request)
  for b in admit:
    real = reals[b]
    if keep and real.tobytes() in row_of:
      row = row_of[real.tobytes()]
    else:
      src, c = prefix.match(real, free) if keep else (-1, 0)
      row = row_of[real.tobytes()] = len(rows)
      rows.append((src, min(c, len(real) - 1), real))  # at least one token to prefill: its logits start the reply
    src, c, _ = rows[row]
    for i in range(g):
      requests.append((row, b * g + i))
      if s.routes and c:
        held_routes[b * g + i] = prefix.routes[src][:c]
  t = prompt_bucket(max(len(real) - c for _, c, real in rows), bucket_min)
  need = max(c for _, c, _ in rows) + t
  if need > state.cache.segment_BxS.shape[1]:  # a long held prefix and the bucket past it
    prefix.cache = state.cache
    prefix.grow(0, fit(need))
    state = dataclasses.replace(state, cache=prefix.cache)
  max_len = state.cache.segment_BxS.shape[1]
  m, n = 1 << (len(rows) - 1).bit_length(), 1 << (len(requests) - 1).bit_length()
  suffix, c_M, n_M, src_M = (np.zeros((m, t), np.int32), np.zeros(m, np.int32), np.ones(m, np.int32),
                             np.zeros(m, np.int32))
  for j, (src, c, real) in enumerate(rows):
    suffix[j, :len(real) - c], c_M[j], n_M[j], src_M[j] = real[c:], c, len(real) - c, max(src, 0)
  slot_N = np.full(n, len(prefix.held), np.int32)  # out of range: the padding requests' writes are dropped
  row_N, request_N = np.zeros(n, np.int32), np.zeros(n, np.int32)
  taken = set()
  for j, (row, request) in enumerate(requests):
    first = rows[row][0] if rows[row][0] not in taken else -1
    slot = prefix.pick(free - taken, refs, first)
    taken.add(slot)
    slot_N[j], row_N[j], request_N[j] = slot, row, request
    serving[slot] = request
    prefix.held[slot], prefix.used[slot] = None, prefix.calls
  free -= taken
  prefix.prompt_tokens += sum(len(reals[r // g]) for _, r in requests)
  prefix.prefill_tokens += int(n_M[:len(rows)].sum())
  kv_len = max_len if ragged else min(max_len, prompt_bucket(need, _MIN_KV))
  state = prefill(params, state, jnp.asarray(suffix), jnp.asarray(n_M), jnp.asarray(c_M), jnp.asarray(src_M),
                  jnp.asarray(slot_N), jnp.asarray(row_N), jnp.asarray(request_N), jnp.asarray(budgets_N[request_N]),
                  rng, kv_len=kv_len)
  return state, max_len


def _init(cfg, cache: KVCache, max_prompt: int, s: Settings) -> Slots:
  slots = cache.segment_BxS.shape[0]
  zeros = lambda dtype=jnp.int32: jnp.zeros((slots,), dtype)  # noqa: E731
  routes = lambda width: jnp.full((slots, width, len(cfg.moe_layers), cfg.experts_per_token), -1,  # noqa: E731
                                  jnp.int32) if s.routes else None
  return Slots(cache, zeros(), zeros(), zeros(), zeros(), zeros(), zeros(bool), zeros(bool),
               jnp.full((slots, s.max_new), s.pad_id, jnp.int32), jnp.zeros((slots, s.max_new), jnp.float32),
               jnp.zeros((3,), jnp.float32), routes(max_prompt), routes(s.max_new))


@functools.lru_cache(maxsize=64)
def _prefill_program(graphdef, s: Settings):
  sample = s.sampler()

  @functools.partial(jax.jit, donate_argnums=(1,), static_argnames=("kv_len",))
  def prefill(params, state: Slots, suffix_MxT, n_M, c_M, src_M, slot_N, row_N, request_N, budget_N, rng, *,
              kv_len: int) -> Slots:
    """Rows [M, T] (right-padded: n_M tokens each) after the c_M positions slot src_M holds, over the first
    `kv_len` positions; request j takes row row_N[j] into slot slot_N[j] (its prefix and the row's keys and values,
    the rest of its segment row cleared) and samples its first token."""
    lm = nnx.merge(graphdef, params)
    old = state.cache
    view = KVCache(tuple(k[src_M, :, :kv_len] for k in old.k), tuple(v[src_M, :, :kv_len] for v in old.v),
                   (jnp.arange(kv_len)[None] < c_M[:, None]).astype(jnp.int32), c_M)
    t = jnp.arange(suffix_MxT.shape[1], dtype=jnp.int32)[None]
    hidden, cache, routing = lm.forward_routed(suffix_MxT, segment_ids=(t < n_M[:, None]).astype(jnp.int32),
                                               positions=c_M[:, None] + t, cache=view)
    len_N = (c_M + n_M)[row_N]
    put = lambda whole, rows: whole.at[slot_N, :, :kv_len].set(rows[row_N], mode="drop")  # noqa: E731
    segment = (jnp.arange(old.segment_BxS.shape[1])[None] < len_N[:, None]).astype(jnp.int32)
    new_cache = KVCache(tuple(map(put, old.k, cache.k)), tuple(map(put, old.v, cache.v)),
                        old.segment_BxS.at[slot_N].set(segment, mode="drop"),
                        old.index.at[slot_N].set(len_N, mode="drop"))
    hidden = hidden[jnp.arange(hidden.shape[0]), n_M - 1][row_N]
    token, logp = sample(lm.logits(hidden), row_keys(rng, request_N, jnp.zeros_like(request_N)))
    stopped = s.stops(token)
    set_ = lambda a, v: a.at[slot_N].set(v, mode="drop")  # noqa: E731
    first = lambda fill, v: jnp.full((slot_N.shape[0], s.max_new), fill, v.dtype).at[:, 0].set(v)  # noqa: E731
    return Slots(new_cache, set_(state.token_S, token), set_(state.pos_S, len_N), set_(state.request_S, request_N),
                 set_(state.step_S, jnp.ones_like(request_N)), set_(state.budget_S, budget_N),
                 set_(state.stopped_S, stopped), set_(state.running_S, ~stopped & (budget_N > 1)),
                 set_(state.tokens_SxR, first(s.pad_id, token)), set_(state.logprobs_SxR, first(0.0, logp)),
                 state.reads, *_prompt_routes(state, routing, n_M, slot_N, row_N))

  return prefill


def _prompt_routes(state: Slots, routing, n_M, slot_N, row_N):
  """(prompt routes, response routes) of `state` with slots `slot_N` holding their rows' experts (whole prompts:
  right-aligned, -1 before) and no response's yet."""
  if state.routes_SxRxLxK is None:
    return None, None
  width = state.prompt_routes_SxPxLxK.shape[1]
  col_MxP = jnp.arange(width, dtype=jnp.int32)[None] - (width - n_M)[:, None]  # the row's token at each column
  ids = jnp.moveaxis(routing.ids_BxTxK, 0, 2)  # [M, T, L, k]
  rows = jnp.take_along_axis(ids, jnp.clip(col_MxP, 0, ids.shape[1] - 1)[:, :, None, None], axis=1)
  rows = jnp.where((col_MxP >= 0)[:, :, None, None], rows, -1)[row_N]
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
                   full.segment_BxS[:, :kv_len], jnp.where(state.running_S, full.index, 0))
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
    # An idle slot rewrites position 0 each step, which no running one writes (it writes past its prompt): put
    # back as it was, so what a slot holds for a later call (`PrefixCache`) survives the calls that leave it idle.
    put = lambda whole, part: whole.at[:, :, 1:kv_len].set(part[:, :, 1:])  # noqa: E731
    cache = KVCache(tuple(map(put, full.k, st.cache.k)), tuple(map(put, full.v, st.cache.v)),
                    full.segment_BxS.at[:, 1:kv_len].set(st.cache.segment_BxS[:, 1:]), st.cache.index)
    return dataclasses.replace(st, cache=cache)

  return decode
