"""PPO with a critic: the critic's values and value loss against NumPy, KL-in-reward advantages against a NumPy
version of verl's recipe, the tiny config end to end with exact resume of the critic and the adaptive KL
coefficient, and bad configs."""
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError
from jalign.losses import advantages as adv_lib
from jalign.losses import policy
from jalign.objectives import ppo
from jalign.rl.batch import RolloutBatch
from tests import cli
from tests.configs_util import run_config


def _batch(rng, n=4, p=5, r=6, vocab=64):
  lengths = rng.randint(1, r + 1, n)  # includes length-1 responses
  mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
  tokens = rng.randint(1, vocab, (n, p + r)).astype(np.int32)
  return RolloutBatch(tokens=jnp.asarray(tokens), segment_ids=jnp.ones((n, p + r), jnp.int32),
                      positions=jnp.broadcast_to(jnp.arange(p + r, dtype=jnp.int32), (n, p + r)),
                      response=jnp.asarray(tokens[:, p:]), response_mask=jnp.asarray(mask),
                      returns=jnp.asarray(rng.randn(n, r), jnp.float32),
                      old_values=jnp.asarray(rng.randn(n, r), jnp.float32))


def test_values_read_the_state_before_each_response_token_and_the_value_loss_is_verls():
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16)
  policy_lm = models.create(cfg, seed=0)
  critic = ppo.make_critic(policy_lm)
  graphdef, params = nnx.split(critic)
  rng = np.random.RandomState(0)
  batch = _batch(rng)
  values = np.asarray(ppo.response_values(graphdef, params, batch))
  hidden, _ = critic.backbone.forward(batch.tokens)
  w, b = np.asarray(critic.head.w_out[...]), np.asarray(critic.head.b_out[...])
  want = np.asarray(hidden)[:, 4:10] @ w[:, 0] + b[0]  # positions p-1 .. p+r-2
  np.testing.assert_allclose(values, want, rtol=1e-5, atol=1e-5)

  num, den, sums = ppo.make_value_loss_fn(graphdef, ppo.ValueLossConfig(clip=0.2))(params, batch)
  m = np.asarray(batch.response_mask, np.float64)
  ret, old = np.asarray(batch.returns), np.asarray(batch.old_values)
  clipped = np.clip(values, old - 0.2, old + 0.2)
  l1, l2 = (values - ret) ** 2, (clipped - ret) ** 2
  np.testing.assert_allclose(float(num / den), 0.5 * np.sum(np.maximum(l1, l2) * m) / m.sum(), rtol=1e-5)
  np.testing.assert_allclose(float(sums["critic/vf_clipfrac"] / den), np.sum((l2 > l1) * m) / m.sum(), rtol=1e-5)
  # The critic starts from the policy but trains its own copy: changing one leaves the other.
  np.testing.assert_array_equal(np.asarray(critic.backbone.embed[...]), np.asarray(policy_lm.embed[...]))
  critic.backbone.embed[...] = critic.backbone.embed[...] + 1.0
  assert float(jnp.max(jnp.abs(critic.backbone.embed[...] - policy_lm.embed[...]))) == 1.0


def test_kl_in_reward_advantages_follow_verl():
  """Token rewards = outcome on the last response token - coef x KL per token; GRPO scores the summed token rewards
  per sequence (group-normalised), GAE bootstraps from the values."""
  rng = np.random.RandomState(1)
  n, r = 8, 5
  mask = (np.arange(r)[None] < rng.randint(1, r + 1, (n, 1))).astype(np.float32)
  scores, groups = rng.rand(n).astype(np.float32), np.repeat(np.arange(2), 4)
  kl = rng.rand(n, r).astype(np.float32) * mask
  last = mask.sum(1).astype(int) - 1
  token = np.zeros((n, r), np.float32)
  token[np.arange(n), last] = scores
  token -= 0.1 * kl
  got = adv_lib.estimate("grpo", jnp.asarray(token), jnp.asarray(mask), jnp.asarray(groups))[0]
  seq = token.sum(1)
  want = np.zeros(n)
  for g in range(2):
    idx = groups == g
    want[idx] = (seq[idx] - seq[idx].mean()) / (seq[idx].std(ddof=1) + 1e-6)
  np.testing.assert_allclose(np.asarray(got), want[:, None] * mask, rtol=1e-4, atol=1e-5)
  values = rng.randn(n, r).astype(np.float32)
  adv, returns = adv_lib.estimate("gae", jnp.asarray(token), jnp.asarray(mask), jnp.asarray(groups),
                                  values_BxT=jnp.asarray(values), gamma=1.0, lam=0.95)
  want_adv, want_ret = adv_lib.gae(jnp.asarray(token), jnp.asarray(values), jnp.asarray(mask), gamma=1.0, lam=0.95)
  np.testing.assert_allclose(np.asarray(adv), np.asarray(want_adv))
  np.testing.assert_allclose(np.asarray(returns), np.asarray(want_ret))
  with pytest.raises(ValueError, match="accepted: grpo, drgrpo, rloo, gae"):
    adv_lib.estimate("ppo", jnp.asarray(token), jnp.asarray(mask), jnp.asarray(groups))


def test_adaptive_kl_controller_matches_ziegler():
  ctl = policy.AdaptiveKL(0.2, target=6.0, horizon=10000)
  ctl.update(9.0, 256)  # error clipped to +0.2
  np.testing.assert_allclose(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000))
  ctl.update(5.4, 256)  # error -0.1
  np.testing.assert_allclose(ctl.value, 0.2 * (1 + 0.2 * 256 / 10000) * (1 - 0.1 * 256 / 10000))


def _run(run_dir, *extra):
  cli.run("ppo.py:tiny", run_dir, "--config.checkpoint.async_save=False", *extra, check=True)
  return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_tiny_ppo_runs_and_resumes_the_critic_and_kl_coefficient_exactly(tmp_path):
  straight = [r for r in _run(tmp_path / "a") if "critic/vf_loss" in r]
  assert [r["step"] for r in straight] == [1, 2, 3]
  for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var", "critic/values/mean",
              "critic/returns/mean", "critic/grad_norm", "actor/pg_loss", "actor/kl_coef", "actor/reward_kl"):
    assert key in straight[-1], key
  assert straight[0]["actor/kl_coef"] != straight[-1]["actor/kl_coef"]  # the adaptive controller moved it
  _run(tmp_path / "b", "--config.train.steps=2")
  resumed = [r for r in _run(tmp_path / "b") if "critic/vf_loss" in r]
  assert [r["step"] for r in resumed] == [1, 2, 3]
  for key in ("critic/vf_loss", "critic/values/mean", "actor/pg_loss", "actor/kl_coef", "critic/score/mean"):
    assert resumed[-1][key] == straight[-1][key], key


@pytest.mark.parametrize("overrides, message", [
    (dict(advantage__estimator="grpo"), r"task 'ppo' trains a critic for GAE"),
    (dict(kl__in_reward=False), r"kl.ctrl='adaptive' steers the KL subtracted from the reward"),
    (dict(advantage__gamma=1.5), r"config.advantage.gamma=1.5: must be in \[0, 1\]"),
    (dict(kl__target=0.0), r"config.kl.target=0.0: must be positive"),
    (dict(critic__value_clip=0.0), r"config.critic.value_clip=0.0: must be positive"),
])
def test_bad_ppo_configs(overrides, message):
  with pytest.raises(ConfigError, match=message):
    run_config("ppo", **overrides)
