"""What sampling programs are specialised on, what they return, and the prompt buckets they compile for."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jalign.sampling.filters import sample_logits


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GenerateOutput:
  tokens: jax.Array         # [N, max_new_tokens] int32; after a row stops: pad_id
  logprobs: jax.Array       # [N, max_new_tokens] float32; 0 after a row stops (see filters.py for the definition)
  lengths: jax.Array        # [N] int32, generated tokens including the stop token
  finish_reason: jax.Array  # [N] int32: 0 = ran out of max_new_tokens, 1 = emitted a stop token
  # [N, P + max_new_tokens, L, k] int32, MoE with `record_routes`: the experts each prompt and response token went to
  # in each layer, columns as the prompt was given then the response; -1 where none (padding, a response's last
  # token, which is never fed back)
  routes: jax.Array | None = None


def prompt_bucket(length: int, minimum: int = 16) -> int:
  """Prompts are left-padded to the next bucket: four per doubling (16, 20, 24, 28, 32, 40, 48, ...; at least
  `minimum`), so a handful of compiled programs serve every length and at most a fifth of a bucket is padding
  (power-of-two buckets padded 18-token prompts to 32: 44% of the prefill and of GRPO's prompt forward wasted)."""
  n = max(length, minimum)
  step = 1 << max((n - 1).bit_length() - 3, 0)  # a quarter of the power of two below n
  return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a compiled sampling program is specialised on."""
  max_new: int
  temperature: float
  top_k: int
  top_p: float
  min_p: float
  stop_ids: tuple[int, ...]
  pad_id: int
  cache_dtype: object
  num_samples: int
  routes: bool = False  # record each token's experts (an MoE model)

  def sampler(self):
    return functools.partial(sample_logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             min_p=self.min_p)

  def stops(self, token_B):
    return jnp.isin(token_B, jnp.asarray(self.stop_ids or (-1,), jnp.int32))
