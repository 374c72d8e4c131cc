"""Advantages, policy losses, aggregation, KL estimators and value loss against loop-by-loop NumPy versions of
verl's `core_algos` definitions, on random inputs with ragged masks (length-1 responses, all-equal groups)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.losses import advantages as A
from jalign.losses import policy as P

B, T = 12, 7


def _inputs(seed=0):
  rng = np.random.RandomState(seed)
  lengths = rng.randint(1, T + 1, B)
  lengths[0] = 1  # a one-token response
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  groups = np.repeat(np.arange(B // 4), 4)
  scores = rng.randint(0, 2, B).astype(np.float32)
  scores[4:8] = 1.0  # a group whose rewards are all equal
  return rng, mask, groups, scores


def np_masked_whiten(x, m):
  mean = (x * m).sum() / m.sum()
  var = (((x - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
  return (x - mean) / np.sqrt(var + 1e-8)


def np_gae(r, v, m, gamma, lam):
  nextv, last, out = np.zeros(B), np.zeros(B), []
  for t in reversed(range(T)):
    delta = r[:, t] + gamma * nextv - v[:, t]
    new = delta + gamma * lam * last
    nextv = v[:, t] * m[:, t] + (1 - m[:, t]) * nextv
    last = new * m[:, t] + (1 - m[:, t]) * last
    out.append(last)
  adv = np.stack(out[::-1], 1)
  return np_masked_whiten(adv, m), adv + v


def test_gae():
  rng, mask, _, _ = _inputs()
  r, v = rng.randn(B, T).astype(np.float32), rng.randn(B, T).astype(np.float32)
  mask[3, 2] = 0  # an observation token inside a response (multi-turn)
  want_adv, want_ret = np_gae(r, v, mask, 0.99, 0.95)
  adv, ret = A.gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(mask), gamma=0.99, lam=0.95)
  np.testing.assert_allclose(ret, want_ret, atol=1e-5)
  np.testing.assert_allclose(np.asarray(adv) * mask, want_adv * mask, atol=1e-4)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(norm):
  _, _, groups, scores = _inputs()
  groups = np.concatenate([groups[:-1], [B - 1]])  # the last row alone in its group
  want = np.zeros(B)
  for i in range(B):
    g = scores[groups == groups[i]]
    mean, std = (g.mean(), g.std(ddof=1)) if len(g) > 1 else (0.0, 1.0)
    want[i] = (scores[i] - mean) / (std + 1e-6) if norm else scores[i] - mean
  np.testing.assert_allclose(A.grpo(jnp.asarray(scores), jnp.asarray(groups), norm_by_std=norm), want, atol=1e-5)
  assert np.all(np.asarray(A.grpo(jnp.asarray(scores), jnp.asarray(groups)))[4:8] == 0)  # equal rewards: no signal


def test_rloo_and_reinforce_pp_baseline():
  _, mask, groups, scores = _inputs(1)
  others = lambda i: [scores[j] for j in range(B) if groups[j] == groups[i] and j != i]
  want = np.array([scores[i] - np.mean(others(i)) for i in range(B)])
  np.testing.assert_allclose(A.rloo(jnp.asarray(scores), jnp.asarray(groups)), want, atol=1e-5)
  centred = np.array([scores[i] - scores[groups == groups[i]].mean() for i in range(B)])
  want = np_masked_whiten(centred[:, None] * mask, mask) * mask
  np.testing.assert_allclose(A.reinforce_pp_baseline(jnp.asarray(scores), jnp.asarray(groups), jnp.asarray(mask)),
                             want, atol=1e-4)


def test_reinforce_pp_and_remax():
  rng, mask, _, _ = _inputs(2)
  r = rng.randn(B, T).astype(np.float32) * mask
  returns = np.zeros((B, T))
  running = np.zeros(B)
  for t in reversed(range(T)):
    running = r[:, t] + 0.9 * running
    returns[:, t] = running
    running = running * mask[:, t]
  adv, ret = A.reinforce_pp(jnp.asarray(r), jnp.asarray(mask), gamma=0.9)
  np.testing.assert_allclose(ret, returns, atol=1e-5)
  np.testing.assert_allclose(adv, np_masked_whiten(returns, mask) * mask, atol=1e-4)
  base = rng.randn(B).astype(np.float32)
  togo = np.flip(np.cumsum(np.flip(r * mask, -1), -1), -1)
  adv, _ = A.remax(jnp.asarray(r), jnp.asarray(base), jnp.asarray(mask))
  np.testing.assert_allclose(adv, togo - base[:, None] * mask, atol=1e-5)


def np_agg(loss, m, mode):
  if mode == "token-mean":
    return (loss * m).sum() / m.sum()
  if mode == "seq-mean-token-sum":
    return (loss * m).sum(-1).mean()
  if mode == "seq-mean-token-mean":
    return ((loss * m).sum(-1) / m.sum(-1)).mean()
  return (loss * m).sum(-1).sum() / (m.shape[0] * m.shape[-1])  # Dr. GRPO as verl and TRL now: B x T


def np_vanilla(logp, old, adv, m, lo, hi, c):
  ratio = np.exp(np.clip(logp - old, -20, 20))
  l1, l2 = -adv * ratio, -adv * np.clip(ratio, 1 - lo, 1 + hi)
  clipped = np.maximum(l1, l2)
  out = np.where(adv < 0, np.minimum(-adv * c, clipped), clipped) if c else clipped
  return out, ((l2 > l1) * m).sum() / m.sum()


@pytest.mark.parametrize("mode", P.AGG_MODES)
@pytest.mark.parametrize("clip_c", [None, 3.0])
def test_vanilla_policy_loss_and_aggregation(mode, clip_c):
  rng, mask, _, _ = _inputs(3)
  logp, old = -rng.rand(B, T) * 3, -rng.rand(B, T) * 3
  adv = rng.randn(B, T) * 2
  loss_mat, clipfrac = np_vanilla(logp, old, adv, mask, 0.2, 0.28, clip_c)
  got, metrics = P.policy_loss(*(jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)), clip_low=0.2,
                               clip_high=0.28, clip_c=clip_c, agg=mode)
  np.testing.assert_allclose(got, np_agg(loss_mat, mask, mode), rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_clipfrac"], clipfrac, rtol=1e-5)
  np.testing.assert_allclose(metrics["ppo_kl"], ((old - logp) * mask).sum() / mask.sum(), rtol=1e-5)


def test_truncated_is_weights():
  rng, mask, _, _ = _inputs(6)
  old, behaviour = -rng.rand(B, T) * 3, -rng.rand(B, T) * 3
  want = np.minimum(np.exp(old - behaviour), 2.0)  # verl: clamp(exp(old_log_prob - rollout_log_probs), max=cap)
  args = [jnp.asarray(x, jnp.float32) for x in (old, behaviour, np.ones((B, T)))]
  token_is = lambda o: P.rollout_correction(o, *args[1:], is_level="token", is_threshold=2.0)  # noqa: E731
  weights, keep = token_is(args[0])
  np.testing.assert_allclose(weights, want, rtol=1e-5)
  assert (want == 2.0).any() and (want < 1.0).any() and np.all(keep == 1.0)
  grad = jax.grad(lambda o: jnp.sum(token_is(o)[0]))(args[0])
  np.testing.assert_array_equal(grad, 0.0)  # a weight, not a path for the gradient


def test_gspo_loss_and_gradient():
  rng, mask, _, _ = _inputs(4)
  logp, old = -rng.rand(B, T), -rng.rand(B, T)
  adv = np.repeat(rng.randn(B, 1), T, 1)
  seq = ((logp - old) * mask).sum(-1) / mask.sum(-1)
  ratio = np.exp(seq)[:, None] * np.ones((B, T))
  l1, l2 = -adv * ratio, -adv * np.clip(ratio, 0.8, 1.2)
  want = np_agg(np.maximum(l1, l2), mask, "seq-mean-token-mean")
  args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv, mask)]
  got, _ = P.policy_loss(*args, mode="gspo", agg="token-mean")
  np.testing.assert_allclose(got, want, rtol=1e-5)
  # d/dlogp of the token term: the token's own ratio carries the gradient, the sequence ratio is held fixed.
  g = jax.grad(lambda lp: P.policy_loss(lp, *args[1:], mode="gspo")[0])(args[0])
  unclipped = (np.maximum(l1, l2) == l1)
  want_g = np.where(unclipped, -adv * ratio, 0.0) * mask / mask.sum(-1, keepdims=True) / B
  np.testing.assert_allclose(g, want_g, atol=1e-6)


def test_kl_estimators():
  rng = np.random.RandomState(5)
  lp, ref = -rng.rand(50) * 4, -rng.rand(50) * 4
  x = lp - ref
  k = np.clip(-x, -20, 20)
  want = {"k1": x, "abs": np.abs(x), "k2": 0.5 * x ** 2, "k3": np.clip(np.exp(k) - k - 1, -10, 10)}  # verl clamps
  for kind, w in want.items():
    np.testing.assert_allclose(P.kl_penalty(jnp.asarray(lp), jnp.asarray(ref), kind), w, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="accepted: k1, abs, k2, k3"):
    P.kl_penalty(jnp.asarray(lp), jnp.asarray(ref), "k4")


def test_value_loss():
  rng, mask, _, _ = _inputs(6)
  v, ret, old = rng.randn(B, T), rng.randn(B, T), rng.randn(B, T)
  clipped = np.clip(v, old - 0.2, old + 0.2)
  l1, l2 = (v - ret) ** 2, (clipped - ret) ** 2
  got, frac = P.value_loss(*(jnp.asarray(x, jnp.float32) for x in (v, ret, old, mask)), clip=0.2)
  np.testing.assert_allclose(got, 0.5 * np_agg(np.maximum(l1, l2), mask, "token-mean"), rtol=1e-5)
  np.testing.assert_allclose(frac, ((l2 > l1) * mask).sum() / mask.sum(), rtol=1e-5)


@pytest.mark.parametrize("mode", P.AGG_MODES)
def test_aggregation_over_micro_batches_and_shards_equals_one_batch(mode):
  """4 micro-batches x 2 data-parallel shards: summed numerators over summed denominators = the global value."""
  rng, mask, _, _ = _inputs(7)
  loss = rng.randn(B, T)
  parts = [P.aggregate_parts(jnp.asarray(loss[i::8]), jnp.asarray(mask[i::8]), mode, global_rows=B)
           for i in range(8)]
  combined = sum(p[0] for p in parts) / sum(p[1] for p in parts)
  np.testing.assert_allclose(combined, np_agg(loss, mask, mode), rtol=1e-5)


def verl_agg_loss_sum_norm(loss, mask, dp_size, global_batch_size, loss_scale_factor=None):
  """verl core_algos.agg_loss, "seq-mean-token-sum-norm", as of its Feb 2026 fix, on one data-parallel rank."""
  seq_losses = (loss * mask).sum(-1)
  seq_mask = (mask.sum(-1) > 0).astype(np.float64)
  out = (seq_losses * seq_mask).sum() / global_batch_size * dp_size
  return out / (loss_scale_factor if loss_scale_factor is not None else mask.shape[-1])


def trl_dr_grpo(loss, mask, max_completion_length, grad_accum_steps):
  """TRL GRPOTrainer._compute_loss, loss_type="dr_grpo", one micro-batch (divided by the accumulation steps)."""
  return (loss * mask).sum() / (loss.shape[0] * max_completion_length) / grad_accum_steps


@pytest.mark.parametrize("horizon", [None, 16])
def test_dr_grpo_denominator_matches_verl_and_trl(horizon):
  """3 micro-batches x 2 data-parallel shards of one global batch: jalign's summed parts equal verl's per-rank
  losses averaged over ranks (DDP's gradient mean) and summed over accumulation steps, and TRL's dr_grpo."""
  rng, mask, _, _ = _inputs(8)
  loss = rng.randn(B, T)
  mask[3] = 0  # a row with no valid token: verl's seq_mask leaves it out of the sum, not out of global_batch_size
  micro, dp = 3, 2   # equal pieces: TRL normalises each micro-batch by its own row count
  pieces = [(loss[i::micro * dp], mask[i::micro * dp]) for i in range(micro * dp)]
  parts = [P.aggregate_parts(jnp.asarray(l), jnp.asarray(m), "seq-mean-token-sum-norm", global_rows=B,
                             horizon=horizon) for l, m in pieces]
  got = float(sum(p[0] for p in parts) / sum(p[1] for p in parts))
  # verl: each micro-batch's loss already carries the global normaliser; ranks' gradients are averaged.
  verl = sum(verl_agg_loss_sum_norm(l, m, dp, B, horizon) for l, m in pieces) / dp
  np.testing.assert_allclose(got, verl, rtol=1e-5)
  trl = sum(trl_dr_grpo(l, m, horizon or T, micro) for l, m in pieces) / dp
  np.testing.assert_allclose(got, trl, rtol=1e-5)
  np.testing.assert_allclose(got, (loss * mask).sum() / (B * (horizon or T)), rtol=1e-5)
  # A batch that leaves out masked rows (compaction) and says which B it stands for keeps the value.
  kept = mask.sum(-1) > 0
  num, den = P.aggregate_parts(jnp.asarray(loss[kept]), jnp.asarray(mask[kept]), "seq-mean-token-sum-norm",
                               norm_rows=B, horizon=horizon)
  np.testing.assert_allclose(float(num / den), got, rtol=1e-5)


def test_adaptive_kl():
  ctl = P.AdaptiveKL(0.1, target=6.0, horizon=10000)
  ctl.update(12.0, 256)  # error clipped to +0.2
  np.testing.assert_allclose(ctl.value, 0.1 * (1 + 0.2 * 256 / 10000))
