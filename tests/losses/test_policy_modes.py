"""The 2025-26 policy losses against their papers' formulas in NumPy: values and, where a stop-gradient shapes the
update, gradients with respect to the current log-probs. Ragged masks, mixed-sign advantages."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.losses import policy as P
from tests.losses.test_rl_losses import B, T, _inputs, np_agg


def _case(seed, spread=0.5):
  rng, mask, _, _ = _inputs(seed)
  old = np.log(rng.uniform(0.05, 0.95, (B, T)))
  logp = np.minimum(old + rng.randn(B, T) * spread, -1e-3)  # some tokens far outside any trust region
  adv = np.repeat(rng.randn(B, 1) * 2, T, 1)
  adv[1] = 0.0  # a zero-advantage row
  return logp, old, adv, mask


def _run(mode, logp, old, adv, mask, agg="token-mean", **kw):
  args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
  value, metrics = P.policy_loss(*args, mode=mode, agg=agg, **kw)
  grad = jax.grad(lambda lp: P.policy_loss(lp, *args[1:], mode=mode, agg=agg, **kw)[0])(args[0])
  return float(value), np.asarray(grad), metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_cispo(agg):
  # MiniMax-M1 (arXiv:2506.13585) eq. 4-5: J = E[sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi].
  logp, old, adv, mask = _case(11)
  r = np.exp(logp - old)
  w = np.clip(r, 0.8, 1.28)
  value, grad, metrics = _run("cispo", logp, old, adv, mask, agg, clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(value, np_agg(-w * adv * logp, mask, agg), rtol=1e-5)
  # Every token keeps its gradient (-w * A per token, before aggregation): clipping changes weights only.
  per_token = np.asarray(jax.grad(lambda lp: jnp.sum(P.policy_loss_matrix(
      lp, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask), clip_low=0.2,
      clip_high=0.28, mode="cispo")[0] * mask))(jnp.asarray(logp, jnp.float32)))
  np.testing.assert_allclose(per_token, -w * adv * mask, rtol=1e-5, atol=1e-7)
  assert ((r < 0.8) | (r > 1.28))[mask > 0].any()
  np.testing.assert_allclose(metrics["pg_clipfrac"], ((w != r) * mask).sum() / mask.sum(), rtol=1e-5)


def test_sapo():
  # SAPO (arXiv:2511.20347) eq. 5-6: f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos if A > 0 else tau_neg;
  # J = mean over sequences of the token mean of f(r) * A (verl aggregates it seq-mean-token-mean).
  logp, old, adv, mask = _case(12)
  r = np.exp(logp - old)
  tau = np.where(adv > 0, 1.0, 1.05)
  sig = 1.0 / (1.0 + np.exp(-tau * (r - 1.0)))
  value, grad, _ = _run("sapo", logp, old, adv, mask, "token-mean", tau_pos=1.0, tau_neg=1.05)
  np.testing.assert_allclose(value, np_agg(-sig * 4 / tau * adv, mask, "seq-mean-token-mean"), rtol=1e-5)
  # d f(r) / d log pi = 4 sigmoid (1 - sigmoid) r: a soft trust region, largest at r = 1, decaying on both sides.
  want = -adv * 4 * sig * (1 - sig) * r * mask / mask.sum(-1, keepdims=True) / B
  np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-7)


def test_geo_mean():
  # GMPO (arXiv:2507.20673): per sequence -A * exp(mean_t clip(log r)), the clip one-sided by the sign of A,
  # averaged over sequences.
  logp, old, adv, mask = _case(13)
  lr = logp - old
  want = []
  for b in range(B):
    m = mask[b] > 0
    a = adv[b, 0]
    kept = np.minimum(lr[b, m], 0.4) if a > 0 else np.maximum(lr[b, m], -0.4) if a < 0 else np.zeros(m.sum())
    want.append(-a * np.exp(kept.mean()))
  value, grad, metrics = _run("geo_mean", logp, old, adv, mask, "token-mean", clip_low=0.4, clip_high=0.4)
  np.testing.assert_allclose(value, np.mean(want), rtol=1e-5)
  assert ((lr > 0.4) & (adv > 0) & (mask > 0)).any()
  # The gradient reaches only tokens inside the clip range, each by -A * ratio_seq / |y| / B.
  inside = np.where(adv > 0, lr <= 0.4, lr >= -0.4)
  seq_ratio = np.array([np.exp(np.where(adv[b] > 0, np.minimum(lr[b], 0.4), np.maximum(lr[b], -0.4))[mask[b] > 0]
                               .mean()) for b in range(B)])
  want_g = -adv * seq_ratio[:, None] * inside * mask / mask.sum(-1, keepdims=True) / B
  np.testing.assert_allclose(grad, want_g, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", ["dppo_tv", "dppo_kl"])
def test_dppo(mode):
  # DPPO (arXiv:2602.04879): REINFORCE with a truncated IS weight on the tokens whose sampled-token divergence
  # (TV: p - p_old; binary KL of p_old against p) stays within the thresholds in the advantage's direction.
  logp, old, adv, mask = _case(14, spread=1.0)
  p, q = np.exp(logp), np.exp(old)
  r = np.exp(logp - old)
  if mode == "dppo_tv":
    valid = np.where(adv > 0, p - q <= 0.15, p - q >= -0.1)
  else:
    bkl = q * (old - logp) + (1 - q) * np.log((1 - q + 1e-8) / (1 - p + 1e-8))
    valid = np.where(adv > 0, (bkl <= 0.15) | (p <= q), (bkl <= 0.1) | (p >= q))
  assert 0 < valid[mask > 0].mean() < 1
  w = np.minimum(r, 5.0)
  value, grad, metrics = _run(mode, logp, old, adv, mask, "token-mean", clip_low=0.1, clip_high=0.15, clip_c=5.0)
  np.testing.assert_allclose(value, np_agg(-adv * w * logp * valid, mask, "token-mean"), rtol=1e-5)
  np.testing.assert_allclose(grad, -adv * w * valid * mask / mask.sum(), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(metrics["pg_clipfrac"], ((1 - valid) * mask).sum() / mask.sum(), rtol=1e-5)


def test_unknown_mode_lists_the_accepted():
  logp, old, adv, mask = _case(15)
  with pytest.raises(ValueError, match="accepted: vanilla, gspo, cispo, sapo, geo_mean, dppo_tv, dppo_kl"):
    _run("ppo2", logp, old, adv, mask)
