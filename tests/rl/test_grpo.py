"""Online GRPO end to end on the tiny config, its metrics, checkpoint resume, and bad configs."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jalign.core.errors import ConfigError
from jalign.data.prompts import Prompt
from jalign.losses.advantages import AdvantageSection
from jalign.rl.batch import RolloutBatch
from jalign.rl.groups import Groups
from jalign.rl.stage import advantages
from jalign.tasks import grpo as grpo_train
from tests import cli
from tests.configs_util import run_config


def _run(run_dir, *extra):
  return cli.run("grpo.py:tiny", run_dir, *extra, check=True).stdout


def test_tiny_grpo_runs_and_reports(tmp_path):
  out = _run(tmp_path / "r")
  assert "held-out gsm8k accuracy" in out
  rows = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
  steps = [r for r in rows if "actor/pg_loss" in r]
  assert [r["step"] for r in steps] == [1, 2, 3]
  for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/kl_loss",
              "critic/score/mean", "response_length/mean", "timing_s/gen", "timing_s/update", "timing_s/step"):
    assert key in steps[-1], key
  # Two mini-batches per step: the second is scored after one update, so the policy has left the reference.
  assert all(r["actor/kl_loss"] > 0 and r["actor/entropy"] > 0 for r in steps)
  assert all(0 <= r["critic/score/mean"] <= 1 for r in steps)
  assert os.path.exists(tmp_path / "r" / "hf" / "model.safetensors")
  # Rerun with more steps: resumes from the step-3 checkpoint instead of starting over.
  _run(tmp_path / "r", "--config.train.steps=4")
  rows = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
  assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("overrides, message", [
    (dict(sampling__num_samples=1), r"config.sampling.num_samples=1: advantage.estimator='grpo' compares "
                                    r"completions of the same prompt"),
    (dict(grpo__mini_batches=3), r"config.grpo.mini_batches=3 does not divide the 16 completions per step"),
    (dict(policy_loss__clip_high=0.1), r"config.policy_loss.clip_high=0.1 must be >= clip_low=0.2"),
    (dict(policy_loss__clip_c=0.5), r"config.policy_loss.clip_c=0.5: must be > 1"),
    (dict(env__name="chess"), r"config.env.name=.chess.: unknown environment; registered: answer, calculator, python"),
    (dict(sampling__temperature=0.0), r"GRPO needs sampled"),
    (dict(sampling__slots=3), r"config.sampling.slots=3 cannot hold a group of sampling.num_samples=4"),
    (dict(advantage__estimator="ppo"), r"config.advantage.estimator: 'ppo' is not accepted; accepted: 'grpo', "
                                      r"'drgrpo', 'rloo', 'gae'"),
    (dict(grpo__prompts_per_step=3, grpo__mini_batches=1), r"12 completions per mini-batch do not split over "
                                                           r"data-parallel size \(data x fsdp x expert = 8\)"),
    (dict(advantage__estimator="reinforce_pp", sampling__num_samples=1), r"dynamic_sampling=True drops groups whose "
                                                                        r"rewards are all equal: with "
                                                                        r"sampling.num_samples=1 every group"),
    (dict(advantage__estimator="remax", grpo__buffer="runs/x"), r"'remax' samples a greedy baseline .* a replay "
                                                               r"buffer \(grpo.buffer\) has none"),
    (dict(policy_loss__rollout_is="token"), r"config.policy_loss.rollout_is='token': rollout corrections need "
                                            r"behaviour log-probs of an older policy, which a replay buffer "
                                            r"\(grpo.buffer\) or asynchronous "
                                     r"rollouts \(grpo.async_staleness > 0\)"),
    (dict(policy_loss__rollout_rs="tokens"), r"config.policy_loss.rollout_rs: 'tokens' is not accepted; accepted: "
                                             r"'', 'token', 'sequence', 'geometric'"),
    (dict(grpo__async_staleness=1, policy_loss__rollout_rs="token", policy_loss__rollout_rs_threshold_lower=3.0),
     r"rollout_rs_threshold_lower=3.0 must be below rollout_rs_threshold=2.0"),
    (dict(grpo__async_staleness=1, grpo__buffer="runs/x"), r"config.grpo.async_staleness=1 overlaps generation "
                                                           r"with the update; offline training"),
    (dict(grpo__async_staleness=1, grpo__partial_rollouts=True), r"config.grpo.partial_rollouts=True spreads a "
                                                                 r"rollout .* set async_staleness >= 2"),
    (dict(grpo__async_staleness=2, grpo__partial_rollouts=True, advantage__estimator="remax"),
     r"partial_rollouts=True with advantage.estimator='remax': partial rollouts sample single-turn"),
    (dict(grpo__dynamic_sampling=False, grpo__max_gen_batches=2), r"config.grpo.max_gen_batches=2: .* only with "
                                                                  r"grpo.dynamic_sampling=True"),
    (dict(grpo__compact_sizes=3), r"config.grpo.compact_sizes=3: needs grpo.dynamic_sampling=True .* must divide "
                                  r"prompts_per_step=4"),
    (dict(grpo__compact_sizes=2, policy_loss__agg="seq-mean-token-mean"), r"compact_sizes=2 with "
                                                                          r"advantage.estimator='grpo', "
                                                                          r"policy_loss.agg='seq-mean-token-mean'"),
    (dict(critic__lr=1e-3), r"config.critic.lr=0.001: only advantage.estimator='gae' trains a critic"),
    (dict(env__max_turns=8), r"config.env.max_turns=8: no environment is set \(env.name\)"),
    (dict(grpo__kl_coef=0.1, grpo__env="calculator"), r"config.grpo.kl_coef: moved to config.kl.coef .*; "
                                                      r"grpo.env is now env.name"),
    (dict(grpo__compact_sizes=4, grpo__mini_batches=1), r"compact_sizes=4: a size step of 4 completions per "
                                                        r"mini-batch does not split over data-parallel size"),
])
def test_bad_grpo_configs(overrides, message):
  with pytest.raises(ConfigError, match=message):
    run_config("grpo", **overrides)


def test_groups_select_takes_informative_groups_first():
  def batch(scores, first_prompt):
    scores = np.asarray(scores, np.float32)
    n = len(scores) // 2
    return Groups(prompts=[f"p{first_prompt + i}" for i in range(n)], size=2,
                  response=np.arange(len(scores))[:, None] + 10 * first_prompt, lengths=np.ones(len(scores), np.int32),
                  scores=scores)
  a = batch([1, 1, 0, 1, 0, 0], 0)       # groups p0 (equal), p1 (informative), p2 (equal)
  b = batch([0, 1, 1, 1, 1, 0], 3)       # p3 (informative), p4 (equal), p5 (informative)
  np.testing.assert_array_equal(a.informative(), [False, True, False])
  picked = Groups.select([a, b], 3)
  assert picked.prompts == ["p1", "p3", "p5"]
  np.testing.assert_array_equal(picked.scores, [0, 1, 0, 1, 1, 0])
  np.testing.assert_array_equal(picked.response[:, 0], [2, 3, 30, 31, 34, 35])
  short = Groups.select([a, b], 5)       # three informative groups, then the equal ones in order
  assert short.prompts == ["p1", "p3", "p5", "p0", "p2"]


def test_dynamic_sampling_refills_informative_groups(tmp_path):
  _run(tmp_path / "r", "--config.grpo.max_gen_batches=3", "--config.train.steps=4")
  steps = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
  steps = [r for r in steps if "actor/gen_batches" in r]
  assert len(steps) == 4
  # Every step either filled all its groups with signal or used up its batches; some step needed a refill.
  assert all(r["actor/informative_groups"] == 1.0 or r["actor/gen_batches"] == 3 for r in steps), steps
  assert any(r["actor/gen_batches"] > 1 for r in steps), steps


@pytest.mark.long  # CI time
def test_compacted_update_equals_the_masked_one(tmp_path):
  """grpo.compact_sizes leaves the groups that dynamic sampling masks out of the update batch: the run samples the
  same completions and ends at the same weights as the one that keeps them in, masked."""
  from safetensors.numpy import load_file
  common = ("--config.train.steps=4", "--config.grpo.mini_batches=1", "--config.grpo.eval_examples=0")
  _run(tmp_path / "masked", *common)
  _run(tmp_path / "compact", *common, "--config.grpo.compact_sizes=2")
  rows = {name: [r for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "actor/pg_loss" in r]
          for name in ("masked", "compact")}
  assert [r["actor/update_groups"] for r in rows["masked"]] == [4] * 4
  assert any(r["actor/update_groups"] < 4 for r in rows["compact"]), rows["compact"]
  for masked, compact in zip(rows["masked"], rows["compact"]):
    assert masked["critic/score/mean"] == compact["critic/score/mean"]  # the same samples
    np.testing.assert_allclose(compact["actor/pg_loss"], masked["actor/pg_loss"], rtol=1e-4, atol=1e-6)
  masked, compact = (load_file(str(tmp_path / name / "hf" / "model.safetensors")) for name in ("masked", "compact"))
  assert masked.keys() == compact.keys()
  for name in masked:  # Adam divides near-zero gradient entries by their own magnitude: 1.7e-6 apart seen once
    np.testing.assert_allclose(compact[name], masked[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.long  # CI time: a forward dropped where unread: test_on_policy_update_skips_the_old_policy_forward
def test_without_a_kl_term_the_reference_runs_only_where_the_kl_is_reported(tmp_path):
  """kl.coef=0 drops the reference forward from the steps that log nothing (here step 1 of 3, logging every 2nd):
  the run ends at the weights of one that computes it on every step (a KL bound forces that) and reports the same
  KL to the reference where it logs."""
  from safetensors.numpy import load_file
  common = ("--config.kl.coef=0", "--config.train.log_every=2", "--config.grpo.mini_batches=1",
            "--config.grpo.eval_examples=0")
  _run(tmp_path / "every", *common, "--config.kl.max=1e9")
  _run(tmp_path / "reported", *common)
  rows = {name: [r for r in map(json.loads, open(tmp_path / name / "metrics.jsonl")) if "actor/pg_loss" in r]
          for name in ("every", "reported")}
  assert [r["step"] for r in rows["reported"]] == [2, 3]
  kl = {name: [r["actor/kl_loss"] for r in rows[name]] for name in rows}
  assert min(kl["every"]) > 0, kl
  np.testing.assert_allclose(kl["reported"], kl["every"], rtol=1e-4)  # the runs' updates round apart (1.4e-5 seen)
  every, reported = (load_file(str(tmp_path / name / "hf" / "model.safetensors")) for name in ("every", "reported"))
  for name in every:
    np.testing.assert_allclose(reported[name], every[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.long  # CI time: the normaliser against its formula: tests/losses/test_rl_losses.py
def test_mini_batch_normaliser_is_the_mini_batch(tmp_path):
  """seq-mean-token-sum-norm divides each update's token sums by the mini-batch's rows x the response length (Dr.
  GRPO as verl and TRL now): with a negligible learning rate (the samples and on-policy ratios stay those of the
  first run), two mini-batches' mean pg_loss equals the single batch's (were B the step's rows, it would be half)."""
  common = ("--config.policy_loss.agg=seq-mean-token-sum-norm", "--config.optim.lr=1e-12", "--config.train.steps=2",
            "--config.grpo.eval_examples=0")
  losses = {}
  for mb in (1, 2):
    _run(tmp_path / f"mb{mb}", *common, f"--config.grpo.mini_batches={mb}")
    losses[mb] = [r["actor/pg_loss"] for r in map(json.loads, open(tmp_path / f"mb{mb}" / "metrics.jsonl"))
                  if "actor/pg_loss" in r]
  assert abs(losses[1][-1]) > 1e-3, losses  # a step whose token sums do not cancel
  np.testing.assert_allclose(losses[2], losses[1], rtol=1e-4, atol=1e-6)


def test_remax_advantages_subtract_the_greedy_reward():
  # ReMax (Li et al. 2023; verl compute_remax_outcome_advantage): every response token's advantage is the sequence
  # reward minus the reward of the same prompt's greedy response.
  mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], np.int32)
  scores, baselines = np.array([1.0, 0.0, 0.5], np.float32), np.array([0.0, 1.0, 0.5], np.float32)
  groups = Groups(prompts=[Prompt(0, [1], "", None, "")], size=3, response=np.ones((3, 3), np.int32),
                  lengths=mask.sum(1), scores=scores, baselines=baselines)
  batch = RolloutBatch.of_groups(groups, 0)
  np.testing.assert_array_equal(batch.response_mask, mask)
  batch, metrics, no_signal = advantages(AdvantageSection(estimator="remax"), batch, groups, critic=None,
                                         reward_kl=None, dynamic_sampling=False,
                                         sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  np.testing.assert_allclose(batch.advantages, (scores - baselines)[:, None] * mask)
  assert not no_signal
  assert metrics["critic/remax_baseline/mean"] == pytest.approx(0.5)


def test_remax_runs_online(tmp_path):
  _run(tmp_path / "r", "--config.advantage.estimator=remax", "--config.train.steps=2")
  steps = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
  steps = [r for r in steps if "critic/remax_baseline/mean" in r]
  assert len(steps) == 2 and all(0.0 <= r["critic/remax_baseline/mean"] <= 1.0 for r in steps)


def test_offline_grpo_reads_the_rollout_buffer(tmp_path):
  cli.run("rollout.py:tiny", tmp_path / "rollout", "--config.rollout.prompts=synthetic:arith:train:16", check=True)
  _run(tmp_path / "offline", f"--config.grpo.buffer={tmp_path / 'rollout' / 'buffer'}",
       "--config.train.steps=2", "--config.grpo.eval_prompts=")
  rows = [json.loads(l) for l in open(tmp_path / "offline" / "metrics.jsonl")]
  steps = [r for r in rows if "actor/pg_loss" in r]
  assert len(steps) == 2
  # Importance ratios are taken against the stored behaviour log-probs, so the first update already sees a
  # (small) policy/behaviour gap rather than exactly 1.
  assert all(abs(r["actor/ppo_kl"]) < 1.0 for r in steps)
  # With truncated importance weights the ratio is taken against the policy before the update (on-policy here:
  # ppo_kl 0) and the behaviour log-probs weight the tokens: at step 1 the policy is the one that wrote the buffer,
  # so the weights are 1 up to the sampler's and the training forward's rounding.
  _run(tmp_path / "tis", f"--config.grpo.buffer={tmp_path / 'rollout' / 'buffer'}", "--config.grpo.mini_batches=1",
       "--config.policy_loss.rollout_is=token", "--config.train.steps=2",
       "--config.grpo.eval_prompts=")
  steps = [json.loads(l) for l in open(tmp_path / "tis" / "metrics.jsonl") if "actor/pg_loss" in l]
  assert len(steps) == 2 and all(r["actor/ppo_kl"] == 0.0 for r in steps)
  assert abs(steps[0]["mismatch/rollout_is_mean"] - 1.0) < 1e-3
  assert steps[0]["mismatch/rollout_is_ratio_fraction_high"] == 0.0
  assert 0.0 < steps[1]["mismatch/rollout_is_mean"] <= 2.0


def test_offline_buffer_checks_group_sizes(tmp_path):
  from jalign.rl.buffer import BufferWriter
  from jalign.rl.groups import OfflineBuffer
  rec = dict(prompt_index=0, group_id=0, prompt_ids=[1, 2], response_ids=[3, 4], behaviour_logprobs=[-0.1, -0.2],
             reward=1.0, ground_truth="1", finish_reason=1, prompt="p", completion="c", policy="x")
  BufferWriter(str(tmp_path)).write(0, [dict(rec, sample=i) for i in range(3)])
  with pytest.raises(ValueError, match="group 0 has 3 completions, sampling.num_samples is 4"):
    OfflineBuffer(str(tmp_path), 4, 8)
  with pytest.raises(ValueError, match="group 0 has a 2-token response, longer than sampling.max_new_tokens=1"):
    OfflineBuffer(str(tmp_path), 3, 1)


def _tiny_model():
  """(graphdef, params) of a 2-layer random decoder over a 64-token vocabulary."""
  from flax import nnx

  from jalign import models
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16)
  graphdef, state = nnx.split(models.create(cfg, seed=0))
  return graphdef, nnx.to_pure_dict(state)


def _tiny_batch(rng, n=4, p=6, r=5):
  """A GRPO batch for `_tiny_model`: n rows of p prompt and r response tokens, ragged response masks, random
  advantages."""
  batch = {"tokens": jnp.asarray(rng.randint(1, 64, (n, p + r)), jnp.int32),
           "segment_ids": jnp.ones((n, p + r), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(p + r), (n, p + r)),
           "response_mask": jnp.asarray(np.arange(r)[None] < rng.randint(1, r + 1, (n, 1)), jnp.int32),
           "advantages": jnp.asarray(rng.randn(n, r), jnp.float32)}
  return RolloutBatch(response=batch["tokens"][:, p:], **batch)


def test_on_policy_update_skips_the_old_policy_forward():
  """Without `old_logp`, the loss and gradients equal those with the old log-probs from a separate forward at the
  same parameters (the on-policy case: ratio 1)."""
  from jalign.objectives import grpo

  graphdef, params = _tiny_model()
  rng = np.random.RandomState(0)
  batch = _tiny_batch(rng)
  batch = batch.replace(ref_logp=jnp.asarray(-rng.rand(*batch.response.shape) * 4))
  loss_fn = grpo.make_loss_fn(graphdef, grpo.GrpoLossConfig(kl_coef=0.1, entropy_coef=0.01))
  with_old = batch.replace(old_logp=grpo.response_logprobs(graphdef, params, batch, 1.0)[0])
  a = jax.value_and_grad(lambda prm: loss_fn(prm, batch)[0])(params)
  b = jax.value_and_grad(lambda prm: loss_fn(prm, with_old)[0])(params)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-6)
  for ga, gb in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-7)


def test_truncated_importance_weights_scale_each_tokens_loss():
  """TIS (verl rollout_is=token): the clipped per-token loss times min(exp(old - behaviour), cap), token-mean, the
  weights carrying no gradient. On-policy (no `old_logp`) that is the plain loss with advantages scaled by the
  weights; with `old_logp` from an earlier policy it is NumPy's clipped surrogate times the weights."""
  from jalign.objectives import grpo

  graphdef, params = _tiny_model()
  rng = np.random.RandomState(1)
  batch = _tiny_batch(rng)
  n, r = batch.response.shape
  logp = np.asarray(grpo.response_logprobs(graphdef, params, batch, 1.0)[0])
  behaviour = logp + rng.randn(n, r) * 0.8  # a stale behaviour policy: weights on both sides of 1 and over the cap
  weights = np.minimum(np.exp(logp - behaviour), 1.5)
  mask = np.asarray(batch.response_mask, np.float32)
  assert (weights[mask > 0] == 1.5).any() and (weights[mask > 0] < 1.0).any()
  cfg = grpo.GrpoLossConfig(kl_coef=0.0, rollout_is="token", rollout_is_threshold=1.5)
  tis = batch.replace(behaviour_logp=jnp.asarray(behaviour, jnp.float32))
  scaled = batch.replace(advantages=batch.advantages * weights)
  a = jax.value_and_grad(lambda prm: (lambda o: o[0] / o[1])(grpo.make_loss_fn(graphdef, cfg)(prm, tis)))(params)
  b = jax.value_and_grad(lambda prm: (lambda o: o[0] / o[1])(
      grpo.make_loss_fn(graphdef, grpo.GrpoLossConfig(kl_coef=0.0))(prm, scaled)))(params)
  np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
  for ga, gb in zip(jax.tree.leaves(a[1]), jax.tree.leaves(b[1])):
    np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-7)
  old = logp + rng.randn(n, r) * 0.3
  num, den, sums = grpo.make_loss_fn(graphdef, cfg)(params, tis.replace(old_logp=jnp.asarray(old, jnp.float32)))
  ratio = np.exp(logp - old)
  adv = np.asarray(batch.advantages)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28)) * np.minimum(np.exp(old - behaviour), 1.5)
  np.testing.assert_allclose(num / den, (per_token * mask).sum() / mask.sum(), rtol=1e-4)
  np.testing.assert_allclose(sums["mismatch/rollout_is_mean"] / den,
                             (np.minimum(np.exp(old - behaviour), 1.5) * mask).sum() / mask.sum(), rtol=1e-4)


@pytest.mark.parametrize("is_level, rs_level", [("sequence", ""), ("", "token"), ("", "sequence"), ("", "geometric"),
                                                ("token", "geometric")])
def test_rollout_corrections_equal_numpy(is_level, rs_level):
  """verl's rollout corrections (algorithm.rollout_correction, 0.6) from their definitions: sequence-level truncated
  IS weights every token by min(prod of the response's ratios, threshold); rejection masks tokens, or whole
  responses by the product or geometric mean of their ratios, outside [lower, upper], in the loss and its
  denominator."""
  from jalign.objectives import grpo

  graphdef, params = _tiny_model()
  rng = np.random.RandomState(2)
  batch = _tiny_batch(rng)
  n, r = batch.response.shape
  logp = np.asarray(grpo.response_logprobs(graphdef, params, batch, 1.0)[0], np.float64)
  mask = np.asarray(batch.response_mask, np.float64)
  old = logp + rng.randn(n, r) * 0.2
  behaviour = old + rng.randn(n, r) * 0.4
  log_ratio = (old - behaviour) * mask
  seq = log_ratio.sum(1, keepdims=True)
  weights = np.ones_like(old)
  if is_level == "token":
    weights = np.minimum(np.exp(log_ratio), 2.0)
  elif is_level == "sequence":
    weights = np.broadcast_to(np.minimum(np.exp(seq), 2.0), old.shape)
  by = {"": None, "token": log_ratio, "sequence": seq, "geometric": seq / mask.sum(1, keepdims=True)}[rs_level]
  keep = np.ones_like(old) if by is None else np.broadcast_to((by >= np.log(0.8)) & (by <= np.log(1.25)), old.shape)
  kept = mask * keep
  assert 0 < kept.sum() < mask.sum() or not rs_level  # the bounds cut something, not everything
  ratio = np.exp(logp - old)
  adv = np.asarray(batch.advantages, np.float64)
  per_token = np.maximum(-adv * ratio, -adv * np.clip(ratio, 0.8, 1.28)) * weights
  cfg = grpo.GrpoLossConfig(kl_coef=0.0, rollout_is=is_level, rollout_rs=rs_level, rollout_rs_threshold=1.25,
                            rollout_rs_threshold_lower=0.8)
  f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
  num, den, sums = grpo.make_loss_fn(graphdef, cfg)(params, batch.replace(old_logp=f32(old),
                                                                          behaviour_logp=f32(behaviour)))
  np.testing.assert_allclose(den, kept.sum(), rtol=1e-6)
  np.testing.assert_allclose(num / den, (per_token * kept).sum() / kept.sum(), rtol=1e-4)
  if rs_level:
    np.testing.assert_allclose(sums["mismatch/rollout_rs_masked_fraction"] / den, 1 - kept.sum() / mask.sum(),
                               rtol=1e-5)


@pytest.mark.long  # CI time: the KL bound's alarm: tests/eval/test_report.py
def test_kl_bound_can_lower_the_learning_rate_instead_of_stopping(tmp_path):
  out = _run(tmp_path / "r", "--config.kl.max=1e-9", "--config.kl.max_action=lower_lr",
             "--config.grpo.entropy_floor=10.0")
  assert "learning rate lowered to 0.5 x optim.lr" in out and "learning rate lowered to 0.25 x optim.lr" in out
  assert "warning: step 1: policy entropy" in out and "entropy collapse" in out  # floor set above any entropy
  rows = [json.loads(l) for l in open(tmp_path / "r" / "metrics.jsonl")]
  lrs = [r["train/lr"] for r in rows if "actor/pg_loss" in r]
  assert lrs == pytest.approx([1e-4, 0.5e-4, 0.25e-4])
  assert [r["monitor/lr_scale"] for r in rows if "monitor/lr_scale" in r] == [0.5, 0.25, 0.125]


@pytest.mark.parametrize("r", [1, 5])
def test_shared_prompts_equal_the_full_forward(r):
  """Groups of samples sharing a left-padded prompt: running each prompt once and its responses on the repeated
  keys/values gives the full forward's log-probs, entropies, loss and gradients (padded prompts, ragged responses)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jalign import kernels
  from jalign.objectives import grpo

  graphdef, params = _tiny_model()
  rng = np.random.RandomState(1)
  groups, g, p = 3, 4, 7
  prompt_mask = (np.arange(p)[None] >= rng.randint(0, 4, (groups, 1))).astype(np.int32)  # left padding
  prompt = rng.randint(1, 64, (groups, p)) * prompt_mask
  lengths = rng.randint(1, r + 1, groups * g)
  response_mask = (np.arange(r)[None] < lengths[:, None]).astype(np.int32)
  response = rng.randint(1, 64, (groups * g, r)) * response_mask
  segment = np.concatenate([np.repeat(prompt_mask, g, 0), response_mask], 1)
  batch = RolloutBatch(
      tokens=jnp.asarray(np.concatenate([np.repeat(prompt, g, 0), response], 1), jnp.int32),
      segment_ids=jnp.asarray(segment), positions=jnp.asarray(np.maximum(np.cumsum(segment, 1) - 1, 0)),
      response=jnp.asarray(response, jnp.int32), response_mask=jnp.asarray(response_mask),
      advantages=jnp.asarray(rng.randn(groups * g, r), jnp.float32),
      ref_logp=jnp.asarray(-rng.rand(groups * g, r) * 4, jnp.float32))
  # jitted: run op by op, the model's forward and backward take minutes on 2 cores
  logprobs = jax.jit(grpo.response_logprobs, static_argnums=(0, 3, 4, 5))
  full = logprobs(graphdef, params, batch, 1.0)
  shared = logprobs(graphdef, params, batch, 1.0, kernels.LogprobOptions(), g)
  mask = response_mask.astype(bool)
  for a, b in zip(full, shared):
    np.testing.assert_allclose(np.asarray(b)[mask], np.asarray(a)[mask], rtol=1e-5, atol=1e-6)
  loss = lambda c: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda prm: grpo.make_loss_fn(graphdef, c)(prm, batch)[0]))(params)
  (la, ga), (lb, gb) = loss(grpo.GrpoLossConfig(kl_coef=0.1)), loss(grpo.GrpoLossConfig(kl_coef=0.1, group_size=g))
  np.testing.assert_allclose(lb, la, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("group_size", [0, 4])
def test_minibatches_partition_rows_and_keep_groups_whole(group_size):
  from jalign.rl.groups import minibatches
  chunks = minibatches(jax.random.key(3), 32, 4, group_size)
  assert len(chunks) == 4 and all(len(c) == 8 for c in chunks)
  assert sorted(np.concatenate(chunks).tolist()) == list(range(32))
  assert not all((np.concatenate(chunks) == np.arange(32)))  # shuffled
  if group_size:  # each chunk holds whole groups, each group's rows in order
    for c in chunks:
      blocks = c.reshape(-1, group_size)
      assert (blocks % group_size == np.arange(group_size)).all()
      assert (blocks // group_size == blocks[:, :1] // group_size).all()
  np.testing.assert_array_equal(minibatches(jax.random.key(3), 32, 1, group_size)[0], np.arange(32))


@pytest.mark.parametrize("mode", ["skip", "update"])
def test_a_reward_without_signal_is_reported_not_trained_on(tmp_path, capsys, mode):
  """exact_match compares the whole completion ('#### 5') with the bare truth ('5'): 0 for every completion, so no
  group carries signal. The run says so, names the reward and a record, and raises no entropy alarm; under 'skip'
  the policy is left as it was."""
  from flax import nnx

  from jalign import models
  run_dir = tmp_path / "r"
  final = grpo_train.run(run_config("grpo", run_dir=str(run_dir), reward__weights=(("exact_match", 1.0),),
                              grpo__no_signal=mode, grpo__no_signal_warn_steps=2, grpo__entropy_floor=10.0,
                              train__steps=3, train__log_every=1, log__progress=False, log__tensorboard=False))
  out = capsys.readouterr().out
  rows = [json.loads(l) for l in open(run_dir / "metrics.jsonl")]
  steps = [r for r in rows if "actor/no_signal" in r]
  assert [r["actor/no_signal"] for r in steps] == [1.0, 1.0, 1.0]
  assert [r["monitor/no_signal_steps"] for r in steps] == [1.0, 2.0, 3.0]
  assert not any("monitor/entropy_collapse" in r for r in rows) and "entropy collapse" not in out
  assert out.count("none of the first 2 steps carried any signal") == 1
  assert "Rewards: exact_match x 1." in out and "synthetic:arith" in out and "(ground truth '" in out
  assert out.count("no signal this step (0 of 4 groups") == 3
  assert final["critic/score/mean"] == 0.0
  shipped = nnx.state(models.from_pretrained(run_config("grpo").model.path, dtype="float32"), nnx.Param)
  trained = nnx.state(models.from_pretrained(str(run_dir / "hf"), dtype="float32"), nnx.Param)
  same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(shipped), jax.tree.leaves(trained)))
  if mode == "skip":
    assert "update skipped" in out and "actor/pg_loss" not in final and same
  else:
    assert "update skipped" not in out and "actor/pg_loss" in final


# CI time: one mode trains in the default run; each mode's loss against its formula: tests/losses/test_policy_modes.py
@pytest.mark.parametrize("mode", ["cispo", *(pytest.param(m, marks=pytest.mark.long)
                                             for m in ("sapo", "geo_mean", "dppo_tv", "dppo_kl"))])
def test_policy_loss_modes_train(tmp_path, mode):
  """Each of the 2025-26 policy losses (tests/losses/test_policy_modes.py checks their formulas) drives a real
  update: finite loss, a non-zero gradient, two mini-batches of one step."""
  extra = ["--config.policy_loss.tau_neg=1.2"] if mode == "sapo" else []  # a key configs/grpo.py leaves at its default
  _run(tmp_path / mode, f"--config.policy_loss.mode={mode}", "--config.train.steps=1", "--config.grpo.eval_examples=0",
       "--config.grpo.mini_batches=2", *extra)
  steps = [r for r in map(json.loads, open(tmp_path / mode / "metrics.jsonl")) if "actor/pg_loss" in r]
  assert len(steps) == 1 and np.isfinite(steps[0]["actor/pg_loss"]) and steps[0]["train/grad_norm"] > 0, steps
