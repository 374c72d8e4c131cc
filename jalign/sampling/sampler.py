"""`generate`: one jitted program per (prompt bucket, settings): prefill the left-padded prompts into a
preallocated KV cache, then decode in a `lax.while_loop` that exits as soon as every row has stopped."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign.models.decoder import Decoder, KVCache
from jalign.models.sharding import state_shardings
from jalign.sampling.filters import sample_logits

FINISH_LENGTH, FINISH_STOP = 0, 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
  tokens: jax.Array         # [N, max_new_tokens] int32; after a row stops: pad_id
  logprobs: jax.Array       # [N, max_new_tokens] float32; 0 after a row stops (see filters.py for the definition)
  lengths: jax.Array        # [N] int32, generated tokens including the stop token
  finish_reason: jax.Array  # [N] int32: 0 = ran out of max_new_tokens, 1 = emitted a stop token


def prompt_bucket(length: int, minimum: int = 16) -> int:
  """Prompts are left-padded to the next bucket: four per doubling (16, 20, 24, 28, 32, 40, 48, ...; at least
  `minimum`), so a handful of compiled programs serve every length and at most a fifth of a bucket is padding
  (power-of-two buckets padded 18-token prompts to 32: 44% of the prefill and of GRPO's prompt forward wasted)."""
  n = max(length, minimum)
  step = 1 << max((n - 1).bit_length() - 3, 0)  # a quarter of the power of two below n
  return -(-n // step) * step


def generate(lm: Decoder, prompt_ids, prompt_mask, rng, *, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, stop_token_ids=(), num_samples: int = 1,
             pad_id: int = 0, cache_dtype=None, bucket_min: int = 16, mesh=None, rules=None) -> GenerateOutput:
  """Samples continuations of left-padded prompts [B, P] (mask 1 = token). Each prompt is repeated `num_samples`
  times (consecutive rows: a GRPO group), so outputs have N = B * num_samples rows.

  With `mesh` and `rules` (e.g. `models.without_fsdp(training_rules)`), the weights are laid out for sampling first
  (one on-device re-layout per call); otherwise generation runs on the weights' current (training) layout."""
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
  pad = ((0, 0), (bucket - p, 0))
  ids = np.pad(prompt_ids, pad, constant_values=pad_id).astype(np.int32)
  mask = np.pad(prompt_mask, pad).astype(np.int32)
  graphdef, params = nnx.split(lm)
  if mesh is not None and rules is not None:
    params = jax.device_put(params, state_shardings(lm, mesh, rules))
  run = _compiled(graphdef, max_new_tokens, float(temperature), int(top_k), float(top_p), float(min_p),
                  tuple(int(t) for t in stop_token_ids), int(pad_id), cache_dtype, int(num_samples))
  return run(params, jnp.asarray(ids), jnp.asarray(mask), rng)


@functools.lru_cache(maxsize=64)
def _compiled(graphdef, max_new, temperature, top_k, top_p, min_p, stop_ids, pad_id, cache_dtype, num_samples):
  sample = functools.partial(sample_logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
  stop = jnp.asarray(stop_ids or (-1,), jnp.int32)

  @jax.jit
  def run(params, ids_BxP, mask_BxP, rng):
    lm = nnx.merge(graphdef, params)
    layers = lm.layer_list()  # sliced once, not per token
    # Each prompt is prefilled once; its cache and last hidden state are repeated for its samples.
    cache = KVCache.init(lm.cfg, ids_BxP.shape[0], ids_BxP.shape[1] + max_new, cache_dtype)
    hidden, cache = lm.forward(ids_BxP, mask_BxP, cache=cache, layers=layers)
    cache = cache.repeat(num_samples)
    hidden = jnp.repeat(hidden[:, -1:], num_samples, axis=0)
    mask_NxP = jnp.repeat(mask_BxP, num_samples, axis=0)
    n = mask_NxP.shape[0]
    rng, key = jax.random.split(rng)
    token, logp = sample(lm.logits(hidden)[:, 0], key)
    next_pos = jnp.sum(mask_NxP, axis=1).astype(jnp.int32)  # position of the first new token
    out_tokens = jnp.full((n, max_new), pad_id, jnp.int32).at[:, 0].set(token)
    out_logp = jnp.zeros((n, max_new), jnp.float32).at[:, 0].set(logp)
    done = jnp.isin(token, stop)

    def cond(carry):
      step, _, _, done, *_ = carry
      return (step < max_new) & ~jnp.all(done)

    def body(carry):
      step, out_tokens, out_logp, done, lengths, token, pos, cache, rng = carry
      hidden, cache = lm.forward(token[:, None], positions=pos[:, None], cache=cache, layers=layers)
      rng, key = jax.random.split(rng)
      new, logp = sample(lm.logits(hidden)[:, 0], key)
      new = jnp.where(done, pad_id, new)
      logp = jnp.where(done, 0.0, logp)
      out_tokens = jax.lax.dynamic_update_slice_in_dim(out_tokens, new[:, None], step, axis=1)
      out_logp = jax.lax.dynamic_update_slice_in_dim(out_logp, logp[:, None], step, axis=1)
      lengths = lengths + (~done).astype(jnp.int32)
      done = done | jnp.isin(new, stop)
      return step + 1, out_tokens, out_logp, done, lengths, new, pos + 1, cache, rng

    carry = (jnp.ones((), jnp.int32), out_tokens, out_logp, done, jnp.ones((n,), jnp.int32), token, next_pos, cache,
             rng)
    _, out_tokens, out_logp, done, lengths, *_ = jax.lax.while_loop(cond, body, carry)
    return GenerateOutput(out_tokens, out_logp, lengths, done.astype(jnp.int32))

  return run
