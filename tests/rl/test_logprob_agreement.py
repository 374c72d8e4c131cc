"""On-policy by construction: the sampler's log-probs of the tokens it drew equal the trainer's forward over the same
rows (GRPO's `objectives.grpo.response_logprobs` on `rl.batch.RolloutBatch.of_rows`) in fp32, whatever else shares
the batch (other prompts, other prompt widths, other orders, other cache slots), and GRPO logs the difference every
logged step."""
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jalign import models
from jalign.data.prompts import encode_prompt
from jalign.data.sources import open_source
from jalign.objectives import grpo as objective
from jalign.rl import rollout
from jalign.rl.batch import RolloutBatch
from jalign.rl.stage import logprob_agreement
from jalign.tokenizers import tokenizer
from tests import cli
from tests.configs_util import ROOT

ASSETS = os.path.join(ROOT, "jalign", "assets")


def _trainer_logp(lm, samples: rollout.Samples, pad_id: int, temperature: float) -> np.ndarray:
  graphdef, params = nnx.split(lm)
  batch = RolloutBatch.of_rows(*samples.prompt_arrays(pad_id), samples.tokens, samples.lengths)
  fn = jax.jit(lambda p, b: objective.response_logprobs(graphdef, p, b, temperature)[0])
  return np.asarray(fn(params, jax.tree.map(jax.numpy.asarray, batch)))


def test_sampler_logprobs_equal_the_trainers_for_any_batch_composition():
  lm = models.from_pretrained(os.path.join(ASSETS, "tiny_policy"))
  tok = tokenizer.load(os.path.join(ASSETS, "arith_tokenizer"))
  source = open_source("synthetic:arith:test:12")
  prompts = [encode_prompt(source[i], tok, index=i, where=source.where(i), max_length=64) for i in range(12)]
  # a long prompt widens the left padding of whichever batch holds it
  prompts[5] = encode_prompt({"prompt": "What is 123456 + 654321 + 111 + 222 + 333 + 444?"}, tok, index=5,
                             where="long", max_length=64)
  spec = rollout.SamplingSection(max_new_tokens=12, temperature=0.8, num_samples=3)
  sampled = rollout.sample(lm, tok, prompts, jax.random.key(0), spec)
  mask = (np.arange(sampled.tokens.shape[1])[None] < sampled.lengths[:, None])
  assert mask.sum() > 100 and len(set(sampled.lengths.tolist())) > 1  # uneven responses

  whole = _trainer_logp(lm, sampled, tok.pad_id, 0.8)
  np.testing.assert_allclose(np.where(mask, whole, 0), np.where(mask, sampled.logprobs, 0), atol=1e-5)
  agreement = logprob_agreement(sampled.logprobs, whole, mask)
  assert agreement["rollout/logprob_abs_diff_max"] < 1e-5

  # The same completions re-batched: reversed, in other groupings, without the long prompt (narrower padding).
  n = spec.num_samples
  for picked in ([11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2], [6, 7], [4, 5]):
    rows = np.concatenate([np.arange(i * n, (i + 1) * n) for i in picked])
    part = rollout.Samples([prompts[i] for i in picked], n, sampled.tokens[rows], sampled.lengths[rows],
                           [sampled.texts[r] for r in rows], sampled.logprobs[rows], sampled.finish[rows])
    got = _trainer_logp(lm, part, tok.pad_id, 0.8)
    np.testing.assert_allclose(np.where(mask[rows], got, 0), np.where(mask[rows], sampled.logprobs[rows], 0),
                               atol=1e-5)

  # Sampled on fewer cache slots (continuous batching: requests refill slots that served others), the same
  # completions (keys are per request) with log-probs equal to the trainer's.
  for slots in (3, 7):
    engine = rollout.sample(lm, tok, prompts, jax.random.key(0), dataclasses.replace(spec, slots=slots))
    np.testing.assert_array_equal(engine.tokens, sampled.tokens)
    np.testing.assert_allclose(np.where(mask, engine.logprobs, 0), np.where(mask, whole, 0), atol=1e-5)


def test_logprob_agreement_masks_padding():
  rollout_logp = np.array([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0]])
  trainer_logp = np.array([[-1.1, -2.0, 0.0], [-0.25, 0.0, 0.0]])
  mask = np.array([[1, 1, 0], [1, 0, 0]])
  out = logprob_agreement(rollout_logp, trainer_logp, mask)
  assert np.isclose(out["rollout/logprob_abs_diff_mean"], (0.1 + 0.0 + 0.25) / 3)
  assert np.isclose(out["rollout/logprob_abs_diff_max"], 0.25)
  assert logprob_agreement(rollout_logp, trainer_logp, np.zeros_like(mask)) == {}


def test_grpo_logs_rollout_agreement(tmp_path):
  cli.run("grpo.py:tiny", tmp_path, "--config.train.steps=2", "--config.train.log_every=1",
          "--config.grpo.eval_examples=0", check=True)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in rows if "rollout/logprob_abs_diff_max" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(0 <= r["rollout/logprob_abs_diff_mean"] <= r["rollout/logprob_abs_diff_max"] < 1e-4 for r in steps)


@pytest.mark.long  # CI time: the metrics in a run: test_sampler_logprobs_equal_the_trainers_for_any_batch_composition
def test_filtered_sampling_is_compared_over_the_same_kept_set(tmp_path):
  """With top-k / top-p the sampler's log-probs are over the tokens it kept; the trainer's full softmax differs from
  them by the kept mass (the bias TRL#6789 documents), its log-probs renormalised over the same set do not."""
  lm = models.from_pretrained(os.path.join(ASSETS, "tiny_policy"))
  tok = tokenizer.load(os.path.join(ASSETS, "arith_tokenizer"))
  source = open_source("synthetic:arith:test:8")
  prompts = [encode_prompt(source[i], tok, index=i, where=source.where(i), max_length=64) for i in range(8)]
  spec = rollout.SamplingSection(max_new_tokens=10, temperature=1.3, top_k=6, top_p=0.9, num_samples=3)
  sampled = rollout.sample(lm, tok, prompts, jax.random.key(1), spec)
  mask = np.arange(sampled.tokens.shape[1])[None] < sampled.lengths[:, None]
  graphdef, params = nnx.split(lm)
  batch = jax.tree.map(jax.numpy.asarray, RolloutBatch.of_rows(*sampled.prompt_arrays(tok.pad_id), sampled.tokens,
                                                               sampled.lengths))
  kept = np.asarray(objective.kept_logprobs(graphdef, params, batch, temperature=1.3, top_k=6, top_p=0.9))
  full = _trainer_logp(lm, sampled, tok.pad_id, 1.3)
  np.testing.assert_allclose(np.where(mask, kept, 0), np.where(mask, sampled.logprobs, 0), atol=1e-5)
  assert np.max(np.abs(np.where(mask, full - sampled.logprobs, 0))) > 0.05  # the full softmax is off by the kept mass

  cli.run("grpo.py:tiny", tmp_path, "--config.train.steps=2", "--config.train.log_every=1",
          "--config.grpo.eval_examples=0", "--config.sampling.top_p=0.9", "--config.sampling.top_k=6",
          "--config.grpo.async_staleness=1", "--config.policy_loss.rollout_is=token", "--config.policy_loss.rollout_rs=token",
          "--config.grpo.mini_batches=1", check=True)
  steps = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if "actor/pg_loss" in line]
  # Step 1 trains on the initial policy's rollouts (lag 0): over the kept set the weights are 1, none masked.
  assert steps[0]["rollout/logprob_abs_diff_max"] < 1e-4
  assert abs(steps[0]["mismatch/rollout_is_mean"] - 1.0) < 1e-4
  assert steps[0]["mismatch/rollout_rs_masked_fraction"] == 0.0
