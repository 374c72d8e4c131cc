"""Reward functions against hand-worked cases and the papers' formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jalign import models
from jalign.models.reward_model import RewardModel
from jalign.rewards import verifiable as R


def _batch(completions, truths, lengths=None):
  return R.Batch(completions, truths, np.asarray(lengths if lengths is not None else [5] * len(completions)),
                 where=[f"prompts.jsonl:{i + 1}" for i in range(len(completions))])


def test_gsm8k_boxed_last_number():
  b = _batch(["so #### 1,234", "#### 12.0", "#### 7 then #### 8", "no answer", "#### -3"],
             ["1234", "12", "8", "4", "-3"])
  np.testing.assert_array_equal(R.REGISTRY["gsm8k"](b), [1, 1, 1, 0, 1])
  b = _batch([r"thus \boxed{\frac{1}{2}}", r"\boxed{42} and \boxed{43}", r"$\boxed{ 7 }$", "42"],
             [r"\frac{1}{2}", "43", "7", "42"])
  np.testing.assert_array_equal(R.REGISTRY["boxed"](b), [1, 1, 1, 0])
  b = _batch(["it is 5, no 6", "none"], ["6", "6"])
  np.testing.assert_array_equal(R.REGISTRY["last_number"](b), [1, 0])


def test_exact_match_and_format():
  np.testing.assert_array_equal(R.REGISTRY["exact_match"](_batch([" yes ", "no"], ["yes", "yes"])), [1, 0])
  np.testing.assert_array_equal(R.REGISTRY["format"](_batch(["#### 12", "#### 12 because", "12", " #### -4 "],
                                                            [None] * 4)), [1, 0, 0, 1])


def test_model_output_is_never_evaluated():
  hostile = ["#### __import__('os').system('echo pwned')", "#### 1+1", "#### 9**9**9**9"]
  np.testing.assert_array_equal(R.REGISTRY["gsm8k"](_batch(hostile, ["2", "2", "1"])), [0, 0, 0])
  np.testing.assert_array_equal(R.REGISTRY["last_number"](_batch(hostile, ["0", "1", "9"])), [0, 1, 1])


def test_overlong_penalty_matches_dapo():
  # DAPO eq. 13 with L_max = 20, L_cache = 4: 0 for |y| <= 16, (16 - |y|) / 4 in (16, 20], -1 beyond.
  lengths = np.array([10, 16, 17, 18, 20, 21, 100])
  np.testing.assert_allclose(R.overlong_penalty(lengths, max_length=20, buffer=4),
                             [0, 0, -0.25, -0.5, -1, -1, -1])
  np.testing.assert_allclose(R.length_penalty(np.array([5, 10, 15]), target=10), [0, 0, -0.5])


def test_weighted_spec():
  spec = R.RewardSpec(weights=(("gsm8k", 1.0), ("format", 0.5)), overlong_max_length=8, overlong_buffer=4)
  total, terms = spec(_batch(["#### 3", "answer #### 3", "#### 4"], ["3", "3", "3"], lengths=[3, 6, 9]))
  np.testing.assert_allclose(terms["gsm8k"], [1, 1, 0])
  np.testing.assert_allclose(terms["format"], [1, 0, 1])
  np.testing.assert_allclose(total, [1.5, 1.0 - 0.5, 0.5 - 1.0])


def test_errors_name_the_problem():
  with pytest.raises(R.RewardError, match=r"unknown reward 'gsm9k'; available: boxed, exact_match, format"):
    R.RewardSpec(weights=(("gsm9k", 1.0),))
  with pytest.raises(R.RewardError, match=r"prompts.jsonl:2: reward 'gsm8k' needs a ground truth"):
    R.REGISTRY["gsm8k"](_batch(["#### 1", "#### 2"], ["1", None]))
  with pytest.raises(R.RewardError, match="overlong_buffer=0 must be in"):
    R.RewardSpec(weights=(("format", 1.0),), overlong_max_length=8, overlong_buffer=0)


def test_reward_model_scores_last_real_token():
  cfg = models.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=8)
  lm = models.create(cfg, seed=0)
  head = models.ScalarHead(16, rngs=nnx.Rngs(1))
  ids = np.array([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7], [5, 6, 7, 0, 0]])
  mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
  rm = RewardModel(lm, head)
  got = np.asarray(jax.jit(lambda i, m: rm.score(i, m))(jnp.asarray(ids), jnp.asarray(mask)))
  alone = np.asarray(head(lm.forward(jnp.asarray([[5, 6, 7]]))[0]))[0, -1]
  np.testing.assert_allclose(got[[0, 2]], [alone, alone], atol=1e-5)  # left or right padding: same score
  assert got.shape == (3,)
