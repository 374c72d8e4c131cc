"""Prefix caching (`generate(..., slots=k, prefix_cache=PrefixCache())`): multi-turn calls whose prompts extend the
previous call's prompts and replies give the samples of the same calls without the cache (same keys), while the
prefills run only the new tokens: the reply's last token and the observation. With fewer slots than episodes the
held prefixes are rewritten and the samples stay the same; new weights drop what is held. An MoE model's recorded
routes over a held prefix are the slot's."""
import jax
import numpy as np
import pytest

from jalign import models, sampling
from jalign.data.prompts import left_pad_ids
from tests import hf_reference as ref

MAX_NEW = 12


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  path = ref.save(ref.build("llama"), tmp_path_factory.mktemp("m") / "llama")
  return path, models.from_pretrained(path)


def _episodes(lm, prefix, slots: int, turns: int = 3, routes: list | None = None):
  """Six episodes (the second and fourth start from one prompt, as a record's episodes do) over `turns` calls; each
  next prompt is the last one, the reply and a 1-5 token observation. Returns per call (tokens, lengths, log-probs,
  prompt tokens, tokens prefilled); `routes` (a list): record the experts and append each call's."""
  rng = np.random.RandomState(3)
  vocab = lm.cfg.vocab_size
  rows = [rng.randint(3, vocab, n).tolist() for n in (30, 9, 17, 9, 4, 22)]
  rows[3] = list(rows[1])
  out = []
  for call in range(turns):
    ids, mask = left_pad_ids(rows, 0)
    stats = {}
    gen = sampling.generate(lm, ids, mask, jax.random.key(call), max_new_tokens=MAX_NEW, temperature=1.0,
                            stop_token_ids=(7,), slots=slots, chunk=4, prefix_cache=prefix, stats=stats,
                            record_routes=routes is not None)
    if routes is not None:
      routes.append((np.asarray(gen.routes), mask))
    tokens, lengths, logp = map(np.asarray, (gen.tokens, gen.lengths, gen.logprobs))
    out.append((tokens, lengths, logp, stats["prompt_tokens"], stats["prefill_tokens"], [len(r) for r in rows]))
    rows = [r + tokens[i, :lengths[i]].tolist() + rng.randint(3, vocab, rng.randint(1, 6)).tolist()
            for i, r in enumerate(rows)]
  return out


def _same_samples(a, b):
  for (ta, la, pa, *_), (tb, lb, pb, *_) in zip(a, b):
    np.testing.assert_array_equal(ta, tb)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_allclose(pa, pb, atol=2e-5)  # the prefix's keys from another program: fp32 rounding


def test_turns_prefill_only_their_new_tokens(llama):
  _, lm = llama
  plain = _episodes(lm, None, slots=6)
  prefix = sampling.PrefixCache()
  cached = _episodes(lm, prefix, slots=6)
  _same_samples(cached, plain)
  for _, _, _, prompt, prefilled, lengths in plain:  # without a cache: every prompt token of every call
    assert prefilled == prompt == sum(lengths)
  first = cached[0]
  assert first[4] == sum(first[5]) - first[5][3]  # the shared first prompt once
  for (_, lengths, *_, rows_then), (*_, prompt, prefilled, rows) in zip(cached, cached[1:]):
    # each episode's next call: its reply's last token (sampled, never fed back) and its observation
    assert prefilled == sum(r - (before + int(n) - 1) for r, before, n in zip(rows, rows_then, lengths))
    assert prompt == sum(rows)
  assert sum(p[4] for p in cached) < 0.4 * sum(p[4] for p in plain)


def test_fewer_slots_than_episodes_rewrite_held_prefixes(llama):
  _, lm = llama
  plain = _episodes(lm, None, slots=2, turns=2)
  prefix = sampling.PrefixCache()
  cached = _episodes(lm, prefix, slots=2, turns=2)
  _same_samples(cached, plain)
  assert len(prefix.held) == 2
  assert sum(p[4] for p in plain) > sum(p[4] for p in cached)  # some held prefixes were still there to extend


def test_new_weights_drop_what_is_held(llama):
  path, lm = llama
  prefix = sampling.PrefixCache()
  ids, mask = left_pad_ids([[5, 9, 4, 8, 3, 12]] * 2, 0)
  kw = dict(max_new_tokens=4, temperature=0.0, slots=2, prefix_cache=prefix)
  first = sampling.generate(lm, ids, mask, jax.random.key(0), **kw)
  prefilled = prefix.prefill_tokens
  assert prefilled == 6  # one row for the two identical prompts
  sampling.generate(lm, ids, mask, jax.random.key(0), **kw)
  assert prefix.prefill_tokens - prefilled == 1  # held: only the prompt's last token (for its logits), once
  again = models.from_pretrained(path)  # the same values in other arrays: an update as far as the cache can tell
  before = prefix.prefill_tokens
  out = sampling.generate(again, ids, mask, jax.random.key(0), **kw)
  assert prefix.prefill_tokens - before == 6
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(first.tokens))


def test_recorded_routes_over_a_held_prefix_are_the_experts_that_computed_it(tmp_path):
  """An MoE model recording its routes (routing replay): with the cache a turn's prompt routes over its held prefix
  come from the slot (the experts its prefill and decode steps used), the rest from this call's prefill. In fp32 the
  sampler routes a token as a forward over the same tokens does, so they equal the routes of the same calls without
  the cache (a whole prefill of every prompt), every real prompt and fed token has them, and the samples are the
  same."""
  lm = models.from_pretrained(ref.save(ref.build("qwen3_moe"), tmp_path / "moe"), dtype="float32")
  plain_routes, cached_routes = [], []
  plain = _episodes(lm, None, slots=6, turns=2, routes=plain_routes)
  prefix = sampling.PrefixCache()
  cached = _episodes(lm, prefix, slots=6, turns=2, routes=cached_routes)
  _same_samples(cached, plain)
  assert sum(c[4] for c in cached[1:]) < sum(c[4] for c in plain[1:]) / 2  # the later turns prefill far less
  for (a, mask), (b, _), (_, lengths, *_) in zip(cached_routes, plain_routes, cached):
    np.testing.assert_array_equal(a, b)
    p = mask.shape[1]
    assert np.all((a[:, :p, 0, 0] >= 0) == (mask == 1))  # every real prompt token, no pad
    fed = np.arange(a.shape[1] - p)[None] < (lengths - 1)[:, None]  # the response tokens fed back
    assert np.all((a[:, p:, 0, 0] >= 0) == fed)


def test_bad_prefix_cache_use(llama):
  _, lm = llama
  ids, mask = left_pad_ids([[5, 9, 4]], 0)
  with pytest.raises(ValueError, match="needs continuous batching"):
    sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=2, prefix_cache=sampling.PrefixCache())
