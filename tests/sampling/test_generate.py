"""Generation: greedy equals transformers' generate; cache decoding equals recomputation; the sampled
distribution is the intended one; the mesh changes nothing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch

from jalign import models, sampling
from tests import hf_reference as ref

PADS = (0, 3, 6)
PROMPT_LEN = 9
MAX_NEW = 12


def _prompts(vocab):
  ids, mask = ref.batch(vocab, pads=PADS, length=PROMPT_LEN, seed=3)
  return np.where(mask == 1, ids, 0), mask


def _hf_greedy(model, ids, mask, eos):
  with torch.no_grad():
    out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=MAX_NEW,
                         do_sample=False, eos_token_id=eos, pad_token_id=0)
  new = out[:, ids.shape[1]:].numpy()
  return np.pad(new, ((0, 0), (0, MAX_NEW - new.shape[1])))


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gemma2", "qwen3_moe", "qwen2_moe", "mixtral",
                                    "qwen3_moe_dense_layers", "gpt_oss", "deepseek_v3", "deepseek_v3_q_proj"])
def test_greedy_equals_transformers_generate(family, tmp_path):
  model = ref.build(family)
  lm = models.from_pretrained(ref.save(model, tmp_path / family))
  ids, mask = _prompts(model.config.vocab_size)
  free = _hf_greedy(model, ids, mask, eos=None)
  eos = int(free[0, 4])  # a token row 0 emits mid-way, so stopping is exercised
  want = _hf_greedy(model, ids, mask, eos=eos)
  out = sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=MAX_NEW, temperature=0.0,
                          stop_token_ids=(eos,))
  np.testing.assert_array_equal(np.asarray(out.tokens), want)
  for row in range(len(ids)):
    hits = np.flatnonzero(want[row] == eos)
    expected_len = hits[0] + 1 if len(hits) else MAX_NEW
    assert int(out.lengths[row]) == expected_len
    assert int(out.finish_reason[row]) == (1 if len(hits) else 0)


def test_cached_logprobs_equal_recomputation(tmp_path):
  """Behaviour log-probs from the cached decode equal a full forward over prompt + completion."""
  model = ref.build("gemma3")
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"))
  ids, mask = _prompts(model.config.vocab_size)
  out = sampling.generate(lm, ids, mask, jax.random.key(1), max_new_tokens=MAX_NEW, temperature=0.7, num_samples=2)
  full = np.concatenate([np.repeat(ids, 2, 0), np.asarray(out.tokens)], axis=1)
  full_mask = np.concatenate([np.repeat(mask, 2, 0), np.ones_like(out.tokens)], axis=1)
  logits = np.asarray(lm(jnp.asarray(full), jnp.asarray(full_mask)), np.float64) / 0.7
  logp = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  picked = np.take_along_axis(logp[:, PROMPT_LEN - 1:-1], np.asarray(out.tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(np.asarray(out.logprobs), picked, atol=2e-5)


def test_num_samples_groups_are_consecutive_and_differ(tmp_path):
  model = ref.build("llama")
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"))
  ids, mask = _prompts(model.config.vocab_size)
  out = sampling.generate(lm, ids, mask, jax.random.key(2), max_new_tokens=MAX_NEW, temperature=1.0, num_samples=4)
  tokens = np.asarray(out.tokens)
  assert tokens.shape == (12, MAX_NEW)
  assert len({tuple(t) for t in tokens[:4]}) > 1  # a group's samples are not copies


def _expected(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
  """Reference filtering in NumPy, from the definitions (HF's TopK/TopP/MinP logits warpers)."""
  z = np.asarray(logits, np.float64) / temperature
  keep = np.ones_like(z, bool)
  if top_k:
    keep &= z >= np.sort(z)[-top_k]
  p = np.exp(z - z.max()) * keep
  p /= p.sum()
  if top_p < 1.0:
    order = np.argsort(-p)
    before = np.cumsum(p[order]) - p[order]
    kept = np.zeros_like(keep)
    kept[order[before < top_p]] = True
    keep &= kept
  if min_p:
    keep &= p >= min_p * p.max()
  q = np.where(keep, p, 0.0)
  return q / q.sum()


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.5), dict(temperature=1.3, top_k=3),
                                      dict(top_p=0.8), dict(temperature=0.8, top_p=0.6), dict(min_p=0.2)])
def test_sampled_frequencies_follow_the_filtered_distribution(settings):
  logits = np.array([2.0, 1.5, 1.0, 0.3, -0.5, -1.0], np.float32)
  n = 40_000
  tokens, logp = sampling.sample_logits(jnp.tile(jnp.asarray(logits), (n, 1)), jax.random.split(jax.random.key(7), n),
                                        **settings)
  want = _expected(logits, **settings)
  counts = np.bincount(np.asarray(tokens), minlength=len(logits))
  assert np.all(counts[want == 0] == 0)
  nz = want > 0
  p_value = scipy.stats.chisquare(counts[nz], want[nz] * n).pvalue
  assert p_value > 1e-3, (counts, want * n)
  np.testing.assert_allclose(np.exp(np.asarray(logp)), want[np.asarray(tokens)], rtol=1e-4)


@pytest.mark.parametrize("slots", [None, 4])  # static; continuous batching on 4 slots, in chunks of 4 steps
def test_generation_on_the_mesh_equals_one_device(tmp_path, slots):
  model = ref.build("qwen2")
  path = ref.save(model, tmp_path / "m")
  ids, mask = _prompts(model.config.vocab_size)
  kw = dict(max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, num_samples=2, slots=slots, chunk=4)
  one = sampling.generate(models.from_pretrained(path), ids, mask, jax.random.key(5), **kw)
  mesh = models.make_mesh((1, 4, 2))
  with jax.set_mesh(mesh):
    eight = sampling.generate(models.from_pretrained(path, mesh=mesh), ids, mask, jax.random.key(5), **kw)
  np.testing.assert_array_equal(np.asarray(eight.tokens), np.asarray(one.tokens))
  np.testing.assert_allclose(np.asarray(eight.logprobs), np.asarray(one.logprobs), atol=1e-5)


def test_bad_prompts(tmp_path):
  model = ref.build("llama")
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"))
  ids, mask = _prompts(model.config.vocab_size)
  empty = mask.copy()
  empty[1] = 0
  with pytest.raises(ValueError, match=r"empty prompt in rows \[1\]"):
    sampling.generate(lm, ids, empty, jax.random.key(0), max_new_tokens=4)
  with pytest.raises(ValueError, match="left-padded"):
    sampling.generate(lm, ids, mask[:, ::-1], jax.random.key(0), max_new_tokens=4)
  with pytest.raises(ValueError, match=r"exceeds the model's context \(128 positions\)"):
    sampling.generate(lm, ids, mask, jax.random.key(0), max_new_tokens=200)


def test_sampling_layout_without_fsdp(tmp_path):
  """Weights re-laid out for sampling (replicated over fsdp, split over tensor) give the same generations."""
  model = ref.build("llama")
  path = ref.save(model, tmp_path / "m")
  ids, mask = _prompts(model.config.vocab_size)
  kw = dict(max_new_tokens=MAX_NEW, temperature=0.0)
  one = sampling.generate(models.from_pretrained(path), ids, mask, jax.random.key(5), **kw)
  mesh = models.make_mesh((1, 4, 2))
  rules = models.without_fsdp(models.DEFAULT_RULES)
  assert dict(rules)["embed"] is None and dict(rules)["batch"] == "data" and dict(rules)["heads"] == "tensor"
  lm = models.from_pretrained(path, mesh=mesh)
  with jax.set_mesh(mesh):
    out = sampling.generate(lm, ids, mask, jax.random.key(5), mesh=mesh, rules=rules, **kw)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
  assert lm.layers.q[...].sharding.spec[1] == "fsdp"  # the training copy keeps its layout
  sampled = models.state_shardings(lm, mesh, rules)["layers"]["q"]
  assert sampled.spec == jax.sharding.PartitionSpec(None, None, "tensor", None)


def test_bf16_model_and_cache(tmp_path):
  """A bf16 model decodes with a bf16 KV cache; its behaviour log-probs agree with a bf16 full forward."""
  model = ref.build("qwen2")
  lm = models.from_pretrained(ref.save(model, tmp_path / "m"), dtype="bfloat16")
  ids, mask = _prompts(model.config.vocab_size)
  out = sampling.generate(lm, ids, mask, jax.random.key(3), max_new_tokens=MAX_NEW, temperature=1.0)
  full = np.concatenate([ids, np.asarray(out.tokens)], axis=1)
  full_mask = np.concatenate([mask, np.ones_like(out.tokens)], axis=1)
  logits = np.asarray(lm(jnp.asarray(full), jnp.asarray(full_mask)), np.float64)
  logp = logits - scipy.special.logsumexp(logits, axis=-1, keepdims=True)
  picked = np.take_along_axis(logp[:, PROMPT_LEN - 1:-1], np.asarray(out.tokens)[..., None], -1)[..., 0]
  assert np.all(np.isfinite(np.asarray(out.logprobs)))
  np.testing.assert_allclose(np.asarray(out.logprobs), picked, atol=0.15)  # bf16 rounding of two code paths


def test_prompt_buckets_pad_little_and_stay_few():
  from jalign.sampling import prompt_bucket
  buckets = [prompt_bucket(n) for n in range(1, 1025)]
  assert buckets[:16] == [16] * 16 and buckets[16:20] == [20] * 4 and prompt_bucket(33) == 40
  assert all(b >= n and b < 1.25 * n for n, b in zip(range(16, 1025), buckets[15:]))
  assert all(b1 <= b2 for b1, b2 in zip(buckets, buckets[1:]))
  assert len(set(buckets)) == 1 + 4 * 6  # 16, then four per doubling up to 1024
