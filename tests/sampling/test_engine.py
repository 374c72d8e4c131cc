"""Continuous batching (`generate(..., slots=k)`) against the static path and against a model forward: the same
samples for the same key, every request served once, no cache entry of a slot's earlier request leaking into the
next, stop tokens and budgets honoured, KV memory set by the slots alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special

from jalign import models, sampling
from jalign.sampling import engine
from tests import hf_reference as ref

MAX_NEW = 24


def _uneven_prompts(vocab, n=7, longest=30, seed=0):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(2, longest + 1, n)
  lengths[0] = longest  # a long prompt first, so later short ones land on slots holding longer stale entries
  ids = np.zeros((n, longest), np.int32)
  mask = np.zeros((n, longest), np.int32)
  for b, length in enumerate(lengths):
    ids[b, longest - length:] = rng.randint(3, vocab, length)
    mask[b, longest - length:] = 1
  return ids, mask


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  model = ref.build("llama")
  return models.from_pretrained(ref.save(model, tmp_path_factory.mktemp("m") / "llama")), model.config.vocab_size


@pytest.mark.parametrize("settings,slots,chunk", [(dict(temperature=0.0), 2, 4), (dict(temperature=1.0), 6, 8),
                                                   (dict(temperature=0.8, top_p=0.9), 64, 32),
                                                   (dict(temperature=1.2, top_k=5), 4, 1)])
def test_continuous_equals_static(llama, settings, slots, chunk):
  lm, vocab = llama
  ids, mask = _uneven_prompts(vocab)
  budgets = np.random.RandomState(1).randint(1, MAX_NEW + 1, len(ids) * 2)
  kw = dict(max_new_tokens=MAX_NEW, num_samples=2, stop_token_ids=(7, 11), budgets=budgets, **settings)
  static = sampling.generate(lm, ids, mask, jax.random.key(4), **kw)
  continuous = sampling.generate(lm, ids, mask, jax.random.key(4), slots=slots, chunk=chunk, **kw)
  np.testing.assert_array_equal(np.asarray(continuous.tokens), np.asarray(static.tokens))
  np.testing.assert_array_equal(np.asarray(continuous.lengths), np.asarray(static.lengths))
  np.testing.assert_array_equal(np.asarray(continuous.finish_reason), np.asarray(static.finish_reason))
  np.testing.assert_allclose(np.asarray(continuous.logprobs), np.asarray(static.logprobs), atol=1e-5)
  assert len(set(np.asarray(static.lengths).tolist())) > 3  # the lengths are uneven: slots are refilled


def test_each_request_once_and_the_cache_set_by_the_slots(llama, monkeypatch):
  lm, vocab = llama
  ids, mask = _uneven_prompts(vocab, n=12)
  admitted, states = [], []
  prefill_program, init = engine._prefill_program, engine._init

  def recording_prefill(graphdef, s):
    run = prefill_program(graphdef, s)

    def prefill(params, state, suffix, n_M, c_M, src_M, slot_N, row_N, request_N, *rest, **kw):
      admitted.extend(np.asarray(request_N)[np.asarray(slot_N) < 3].tolist())  # padding rows go to slot 3 (dropped)
      return run(params, state, suffix, n_M, c_M, src_M, slot_N, row_N, request_N, *rest, **kw)
    return prefill

  monkeypatch.setattr(engine, "_prefill_program", recording_prefill)
  monkeypatch.setattr(engine, "_init", lambda *a: states.append(init(*a)) or states[-1])
  out = sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=MAX_NEW, num_samples=1, slots=3, chunk=4)
  assert sorted(admitted) == list(range(12))
  assert np.all(np.asarray(out.lengths) >= 1)
  cfg = lm.cfg
  max_len = sampling.prompt_bucket(ids.shape[1]) + MAX_NEW
  kv_bytes = 2 * cfg.num_layers * 3 * cfg.num_kv_heads * max_len * cfg.head_dim * np.dtype(cfg.dtype).itemsize
  assert states[0].cache.num_bytes() == kv_bytes + 3 * max_len * 4  # 3 slots, whatever the number of requests


def test_refilled_slots_do_not_see_earlier_requests(llama):
  """Two slots serve 14 requests; each request's behaviour log-probs equal a forward over its own prompt and tokens."""
  lm, vocab = llama
  ids, mask = _uneven_prompts(vocab, n=7, seed=3)
  out = sampling.generate(lm, ids, mask, jax.random.key(2), max_new_tokens=MAX_NEW, num_samples=2, slots=2, chunk=3,
                          temperature=1.0)
  tokens, lengths, logprobs = map(np.asarray, (out.tokens, out.lengths, out.logprobs))
  # Every request's prompt and tokens in one right-padded forward (causal: the padding after a row's tokens does not
  # reach them), one program instead of one per length.
  rows = [np.concatenate([ids[n // 2][mask[n // 2] == 1], tokens[n, :lengths[n]]]) for n in range(len(tokens))]
  full = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for n, row in enumerate(rows):
    full[n, :len(row)] = row
  all_logits = np.asarray(lm(jnp.asarray(full), jnp.ones_like(jnp.asarray(full))), np.float64)
  for n in range(len(tokens)):
    real = ids[n // 2][mask[n // 2] == 1]
    logits = all_logits[n, :len(rows[n])]
    logp = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)
    want = logp[len(real) - 1:-1][np.arange(lengths[n]), tokens[n, :lengths[n]]]
    np.testing.assert_allclose(logprobs[n, :lengths[n]], want, atol=2e-5)


def test_stop_tokens_and_budgets(llama):
  lm, vocab = llama
  ids, mask = _uneven_prompts(vocab, n=9, seed=5)
  free = sampling.generate(lm, ids, mask, jax.random.key(6), max_new_tokens=MAX_NEW, temperature=0.0, slots=4)
  stop = int(np.asarray(free.tokens)[1, 3])  # a token some request emits, so stopping is exercised
  budgets = np.random.RandomState(2).randint(1, MAX_NEW + 1, len(ids))
  out = sampling.generate(lm, ids, mask, jax.random.key(6), max_new_tokens=MAX_NEW, temperature=0.0, slots=4,
                          stop_token_ids=(stop,), budgets=budgets, pad_id=0)
  tokens, lengths, finish = map(np.asarray, (out.tokens, out.lengths, out.finish_reason))
  free_tokens = np.asarray(free.tokens)
  for n in range(len(ids)):
    hits = np.flatnonzero(free_tokens[n] == stop)
    want = min(hits[0] + 1 if len(hits) else MAX_NEW, budgets[n])
    assert lengths[n] == want
    assert finish[n] == int(len(hits) > 0 and hits[0] + 1 <= budgets[n])
    np.testing.assert_array_equal(tokens[n, :want], free_tokens[n, :want])
    assert np.all(tokens[n, want:] == 0)
  assert finish.sum() >= 1 and (finish == 0).sum() >= 1


def test_bad_slots_and_budgets(llama):
  lm, vocab = llama
  ids, mask = _uneven_prompts(vocab, n=2)
  with pytest.raises(ValueError, match="slots=2 cannot hold a group of num_samples=4"):
    sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=4, num_samples=4, slots=2)
  with pytest.raises(ValueError, match=r"budgets must be \[2\] .* max_new_tokens=4"):
    sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=4, budgets=[1, 5])


def test_read_counters_follow_each_slots_length(llama):
  """`stats`: per decode step, the dense form reads slots x the bound, a per-slot-length kernel each slot's length
  (index + 1; a finished slot stands at length 1 from the step after its last). One prompt of 5 tokens, two samples
  with budgets 3 and 5 (2 and 4 decode steps), two slots, one decode call (bound: the whole cache, prompt bucket 16
  + max_new_tokens 8, under 5 + chunk 32 -> 64)."""
  lm, _ = llama
  ids, mask = np.asarray([[7, 8, 9, 10, 11]], np.int32), np.ones((1, 5), np.int32)
  stats = {}
  out = sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=8, num_samples=2, slots=2,
                          budgets=np.asarray([3, 5]), stats=stats)
  assert np.asarray(out.lengths).tolist() == [3, 5]
  n = 5  # slot indices after the prefill: both at the prompt's length
  per_step = [2 * (n + 1), 2 * (n + 2), 2 * (n + 3), 1 + (n + 4)]  # A finishes after step 2: read at n + 3, then 1
  assert stats["decode_steps"] == 4
  assert stats["read_lengths"] == pytest.approx(sum(per_step) / 4)
  assert stats["read_bound"] == pytest.approx(2 * 24)
