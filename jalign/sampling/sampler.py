"""`generate`: the static path is one jitted program per (prompt bucket, settings): prefill the left-padded prompts
into a preallocated KV cache, then decode in a `lax.while_loop` that exits as soon as every row has stopped. The
continuous path is `jalign.sampling.engine`."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.models.decoder import Decoder
from jalign.models.kv_cache import KVCache
from jalign.models.sharding import state_shardings
from jalign.sampling import engine
from jalign.sampling.filters import row_keys
from jalign.sampling.settings import GenerateOutput, Settings, prompt_bucket


def generate(lm: Decoder, prompt_ids, prompt_mask, rng, *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, stop_token_ids=(), num_samples: int = 1,
             pad_id: int = 0, cache_dtype=None, bucket_min: int = 16, mesh=None, rules=None, budgets=None,
             slots: int | None = None, chunk: int = 32, stats: dict | None = None,
             record_routes: bool = False, prefix_cache: engine.PrefixCache | None = None) -> GenerateOutput:
  """Samples continuations of left-padded prompts [B, P] (mask 1 = token). Each prompt is repeated `num_samples`
  times (consecutive rows: a GRPO group), so outputs have N = B * num_samples rows; row n is request n, and its
  t-th token is drawn with the key (request n, step t) whatever batch or slot it runs in.

  `slots=None`: one static batch (every row decodes until the last one stops). `slots=k`: continuous batching over k
  cache slots (`jalign.sampling.engine`; a whole group at a time, so k >= num_samples; 0 = one slot per request; more
  than N: N rounded up to a power of two), the same samples for the same `rng`; `stats` (a dict) gets the engine's decode counters (`engine.run`).
  `budgets` [N]: each request's own token budget (<= max_new_tokens), as a per-request max_tokens.
  With `mesh` and `rules` (e.g. `models.without_fsdp(training_rules)`), the weights are laid out for sampling first
  (one on-device re-layout per call); otherwise generation runs on the weights' current (training) layout.
  `record_routes` (an MoE model): the output's `routes`, the experts every token went to (routing replay).
  `prefix_cache` (continuous batching): a `sampling.PrefixCache` kept across calls with the same weights, so a
  prompt that extends an earlier call's prompt and response (a multi-turn episode's next turn) prefills only its new
  tokens, and identical prompts of a call are prefilled once (`sampling.prefix`)."""
  prompt_ids, prompt_mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
  if prompt_ids.ndim != 2 or prompt_ids.shape != prompt_mask.shape:
    raise ValueError(f"prompt_ids {prompt_ids.shape} and prompt_mask {prompt_mask.shape} must both be [B, P]")
  if (prompt_mask.sum(1) == 0).any():
    raise ValueError(f"empty prompt in rows {np.flatnonzero(prompt_mask.sum(1) == 0).tolist()}")
  if (prompt_mask[:, -1] == 0).any():
    raise ValueError("prompts must be left-padded (every row's last position a real token)")
  p = prompt_ids.shape[1]
  bucket = prompt_bucket(p, bucket_min)
  if bucket + max_new_tokens > lm.cfg.max_position_embeddings:
    raise ValueError(f"prompt bucket {bucket} + max_new_tokens {max_new_tokens} exceeds the model's context "
                     f"({lm.cfg.max_position_embeddings} positions)")
  n = len(prompt_ids) * num_samples
  budgets = np.full(n, max_new_tokens, np.int32) if budgets is None else np.asarray(budgets, np.int32)
  if budgets.shape != (n,) or budgets.min() < 1 or budgets.max() > max_new_tokens:
    raise ValueError(f"budgets must be [{n}] (one per request) with values in [1, max_new_tokens={max_new_tokens}]"
                     f", got shape {budgets.shape}")
  if record_routes and not lm.cfg.num_experts:
    raise ValueError(f"record_routes: the model ({lm.cfg.model_type}) has no experts")
  if slots is not None:
    # fewer requests than slots: a power of two of them, so calls with varying request counts share programs
    slots = min(slots, 1 << (n - 1).bit_length()) if slots else n
  if slots is not None and slots < num_samples:
    raise ValueError(f"slots={slots} cannot hold a group of num_samples={num_samples}")
  if prefix_cache is not None and slots is None:
    raise ValueError("prefix_cache needs continuous batching: pass slots (0 = one per request)")
  graphdef, params = nnx.split(lm)
  weights = params
  if mesh is not None and rules is not None:
    params = jax.device_put(params, state_shardings(lm, mesh, rules))
  settings = Settings(max_new_tokens, float(temperature), int(top_k), float(top_p), float(min_p),
                      tuple(int(t) for t in stop_token_ids), int(pad_id), cache_dtype, int(num_samples),
                      bool(record_routes))
  if slots is not None:
    return engine.run(graphdef, params, prompt_ids, prompt_mask, budgets, rng, settings, slots=slots, chunk=chunk,
                      bucket_min=bucket_min, stats=stats, prefix=prefix_cache, weights=weights)
  pad = ((0, 0), (bucket - p, 0))
  ids = np.pad(prompt_ids, pad, constant_values=pad_id).astype(np.int32)
  mask = np.pad(prompt_mask, pad).astype(np.int32)
  out = _compiled(graphdef, settings)(params, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(budgets), rng)
  if out.routes is not None:  # the bucket's columns -> the prompt's as given
    out = dataclasses.replace(out, routes=out.routes[:, bucket - p:])
  return out


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, s: Settings):
  sample, max_new, pad_id = s.sampler(), s.max_new, s.pad_id

  @jax.jit
  def run(params, ids_BxP, mask_BxP, budget_N, rng):
    lm = nnx.merge(graphdef, params)
    layers = lm.layer_list()  # sliced once, not per token
    # Each prompt is prefilled once; its cache and last hidden state are repeated for its samples.
    cache = KVCache.init(lm.cfg, ids_BxP.shape[0], ids_BxP.shape[1] + max_new, s.cache_dtype)
    hidden, cache, routing = lm.forward_routed(ids_BxP, mask_BxP, cache=cache, layers=layers)
    cache = cache.repeat(s.num_samples)
    hidden = jnp.repeat(hidden[:, -1:], s.num_samples, axis=0)
    mask_NxP = jnp.repeat(mask_BxP, s.num_samples, axis=0)
    n = mask_NxP.shape[0]
    request = jnp.arange(n, dtype=jnp.int32)
    token, logp = sample(lm.logits(hidden)[:, 0], row_keys(rng, request, jnp.zeros_like(request)))
    next_pos = jnp.sum(mask_NxP, axis=1).astype(jnp.int32)  # position of the first new token
    out_tokens = jnp.full((n, max_new), pad_id, jnp.int32).at[:, 0].set(token)
    out_logp = jnp.zeros((n, max_new), jnp.float32).at[:, 0].set(logp)
    stopped = s.stops(token)
    lengths = jnp.ones((n,), jnp.int32)
    routes = None  # [L, N, max_new, k]: response token t's experts, recorded when it is fed back (step t + 1)
    if s.routes:
      routes = jnp.full(routing.ids_BxTxK.shape[:1] + (n, max_new) + routing.ids_BxTxK.shape[3:], -1, jnp.int32)

    def cond(carry):
      step, _, _, stopped, lengths, *_ = carry
      return (step < max_new) & ~jnp.all(stopped | (lengths >= budget_N))

    def body(carry):
      step, out_tokens, out_logp, stopped, lengths, token, pos, cache, routes = carry
      done = stopped | (lengths >= budget_N)
      hidden, cache, routing = lm.forward_routed(token[:, None], positions=pos[:, None], cache=cache,
                                                 layers=layers)
      if routes is not None:  # `token` is response token step - 1 while step <= length
        fed = jnp.where((step <= lengths)[None, :, None, None], routing.ids_BxTxK, -1)
        routes = jax.lax.dynamic_update_slice_in_dim(routes, fed, step - 1, axis=2)
      new, logp = sample(lm.logits(hidden)[:, 0], row_keys(rng, request, jnp.full_like(request, step)))
      new = jnp.where(done, pad_id, new)
      logp = jnp.where(done, 0.0, logp)
      out_tokens = jax.lax.dynamic_update_slice_in_dim(out_tokens, new[:, None], step, axis=1)
      out_logp = jax.lax.dynamic_update_slice_in_dim(out_logp, logp[:, None], step, axis=1)
      lengths = lengths + (~done).astype(jnp.int32)
      stopped = stopped | (~done & s.stops(new))
      return step + 1, out_tokens, out_logp, stopped, lengths, new, pos + 1, cache, routes

    carry = (jnp.ones((), jnp.int32), out_tokens, out_logp, stopped, lengths, token, next_pos, cache, routes)
    _, out_tokens, out_logp, stopped, lengths, *_, routes = jax.lax.while_loop(cond, body, carry)
    if routes is not None:  # [N, P + max_new, L, k]; padding -1
      prompt = jnp.where(mask_BxP[None, :, :, None] > 0, routing.ids_BxTxK, -1)
      routes = jnp.moveaxis(jnp.concatenate([jnp.repeat(prompt, s.num_samples, axis=1), routes], axis=2), 0, 2)
    return GenerateOutput(out_tokens, out_logp, lengths, stopped.astype(jnp.int32), routes)

  return run
