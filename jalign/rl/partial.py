"""Partial rollouts (`grpo.partial_rollouts`): a step's responses are sampled a segment at a time over the updates
before the step, each segment by the policy of its time, instead of wholly by the oldest one. At a weight update the
responses in flight continue under the new weights: their prompt and tokens so far are prefilled by the new policy
(its own keys and values, not the old policy's) and sampling goes on from there. Every token keeps the log-prob it
was drawn with and the policy version that drew it (verl's partial rollouts in its fully asynchronous trainer; AReaL's
interruptible generation, Fu et al. 2025, which also recomputes the cache under the new weights)."""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from jalign import sampling
from jalign.data.prompts import Prompt, left_pad, left_pad_ids
from jalign.models.sharding import to_host
from jalign.rl.rollout import Samples, SamplingSection


@dataclasses.dataclass
class Partial:
  """`n` responses per prompt, sampled up to their lengths so far (prompt i owns rows i*n .. i*n+n-1)."""
  prompts: list[Prompt]
  n: int
  tokens: np.ndarray     # [N, R] int32 token ids, pad after each length
  logprobs: np.ndarray   # [N, R] float32: each token's log-prob under the distribution it was drawn from
  versions: np.ndarray   # [N, R] int32: the policy version (updates applied) that drew each token; -1 past the length
  lengths: np.ndarray    # [N] int32
  stopped: np.ndarray    # [N] bool: ended on a stop token
  segments: int = 0      # segments sampled so far
  seconds: float = 0.0   # sampling time so far

  @classmethod
  def start(cls, prompts: list[Prompt], n: int, max_new: int, pad_id: int) -> "Partial":
    rows = len(prompts) * n
    return cls(prompts, n, np.full((rows, max_new), pad_id, np.int32), np.zeros((rows, max_new), np.float32),
               np.full((rows, max_new), -1, np.int32), np.zeros(rows, np.int32), np.zeros(rows, bool))

  def open(self) -> np.ndarray:
    """Rows still sampling: not stopped and under max_new_tokens."""
    return ~self.stopped & (self.lengths < self.tokens.shape[1])

  def advance(self, lm, tok, key, spec: SamplingSection, version: int, limit: int | None, *, mesh=None,
              rules=None) -> None:
    """Sample the open rows by `lm` (policy `version`) for up to `limit` more tokens each (None: to the end). The
    first segment prefills each prompt once for its group; later ones each row's prompt and tokens so far."""
    t0 = time.perf_counter()
    rows = np.flatnonzero(self.open())
    if not rows.size:
      return
    remaining = self.tokens.shape[1] - self.lengths[rows]
    budgets = remaining if limit is None else np.minimum(remaining, limit)
    if self.segments == 0:  # every row open, none sampled yet: the groups as the synchronous sampler forms them
      ids, mask = left_pad(self.prompts, tok.pad_id)
      n = self.n
    else:
      ids, mask = left_pad_ids([list(self.prompts[r // self.n].ids) + self.tokens[r, :self.lengths[r]].tolist()
                                for r in rows], tok.pad_id)
      n = 1
    stop = tuple(t for t in (tok.eos_id,) if t is not None)
    # The same programs each segment (a call's shapes are its settings, slots and buckets): max_new_tokens is the
    # segment's or the whole response's, each row's own limit a budget; the slots cover the whole rollout's rows.
    out = sampling.generate(lm, ids, mask, key, max_new_tokens=limit or self.tokens.shape[1],
                            temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p,
                            stop_token_ids=stop, num_samples=n, pad_id=tok.pad_id, mesh=mesh, rules=rules,
                            slots=spec.slots or len(self.tokens), budgets=budgets)
    tokens, lengths, logprobs, finish = to_host((out.tokens, out.lengths, out.logprobs, out.finish_reason))
    for j, r in enumerate(rows):
      a, b = self.lengths[r], self.lengths[r] + lengths[j]
      self.tokens[r, a:b], self.logprobs[r, a:b], self.versions[r, a:b] = tokens[j, :lengths[j]], \
          logprobs[j, :lengths[j]], version
      self.lengths[r] = b
      self.stopped[r] = bool(finish[j])
    self.segments += 1
    self.seconds += time.perf_counter() - t0

  def samples(self, tok) -> Samples:
    """The finished responses as the scorer reads them."""
    texts = [tok.decode(self.tokens[i, :self.lengths[i]]) for i in range(len(self.tokens))]
    return Samples(self.prompts, self.n, self.tokens, self.lengths, texts, self.logprobs,
                   self.stopped.astype(np.int32))

  def to_json(self) -> dict:
    out = {"prompts": [dataclasses.asdict(p) for p in self.prompts], "n": self.n, "segments": self.segments,
           "seconds": self.seconds}
    for name in ("tokens", "logprobs", "versions", "lengths", "stopped"):
      a = getattr(self, name)
      out[name] = {"dtype": str(a.dtype), "shape": list(a.shape), "data": a.ravel().tolist()}
    return out

  @classmethod
  def from_json(cls, obj: dict) -> "Partial":
    arrays = {name: np.asarray(obj[name]["data"], obj[name]["dtype"]).reshape(obj[name]["shape"])
              for name in ("tokens", "logprobs", "versions", "lengths", "stopped")}
    return cls([Prompt(**p) for p in obj["prompts"]], obj["n"], segments=obj["segments"], seconds=obj["seconds"],
               **arrays)


def segment_tokens(max_new: int, staleness: int) -> int:
  """Tokens per segment before a response's last one: max_new_tokens spread over the `staleness` updates a rollout
  spans."""
  return -(-max_new // staleness)
