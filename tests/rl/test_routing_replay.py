"""Routing replay for RL on an MoE policy (`grpo.routing_replay`): the sampler's experts travel with the rollout
(online, asynchronous, through a replay buffer and dynamic sampling's regrouping) into the update batch, whose
forwards route by them; `rollout/routing_mismatch` reports how often the trainer's router would have chosen
otherwise. The policy is the shipped tiny one upcycled to 4 experts (copies perturbed so they differ)."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError, DataError
from jalign.data.prompts import Prompt
from jalign.models.upcycle import upcycle
from jalign.objectives import grpo as objective
from jalign.rl import rollout
from jalign.rl.batch import RolloutBatch
from jalign.rl.groups import Groups
from jalign.tasks import grpo as grpo_task
from jalign.tasks import rollout as rollout_task
from jalign.tokenizers.tokenizer import load as load_tokenizer
from tests import cli
from tests.configs_util import run_config

QUIET = dict(log__progress=False, log__tensorboard=False)
TINY = "jalign/assets/tiny_policy"


@pytest.fixture(scope="module")
def moe_policy(tmp_path_factory):
  """The tiny policy upcycled to 4 experts, top 2 (Mixtral), saved with its tokenizer."""
  out = tmp_path_factory.mktemp("moe") / "policy"
  dense = models.from_pretrained(f"{cli.ROOT}/{TINY}", dtype="float32")
  models.save_pretrained(upcycle(dense, num_experts=4, experts_per_token=2, noise=0.3, seed=0), str(out))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{cli.ROOT}/{TINY}/{name}", out / name)
  return str(out)


@pytest.fixture(autouse=True)
def _no_cache_writes():
  """No entries written to the test run's persistent compilation cache from this module: in a full run the routed
  GRPO update's executable has crashed the process (SIGSEGV in XLA:CPU's executable serialisation, in
  `put_executable_and_time`; never when the test runs alone), twice in the same test. Reads stay on."""
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
  yield
  jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _steps(run_dir):
  return [json.loads(line) for line in open(run_dir / "metrics.jsonl") if "actor/pg_loss" in line]


@pytest.mark.parametrize("replay", [pytest.param(True, marks=pytest.mark.long), False])  # CI time: one of two
def test_online_grpo_replays_the_samplers_experts(moe_policy, tmp_path, replay):
  """fp32, on-policy: the sampler's experts are the trainer's own choices (mismatch 0) and its log-probs the
  trainer's; the update runs with the routes column exactly when replaying."""
  cfg = run_config("grpo", run_dir=str(tmp_path), model__path=moe_policy, train__steps=2, grpo__routing_replay=replay,
                   grpo__no_signal="update", **QUIET)
  task = grpo_task.task(cfg)
  grpo_task.loop.run(cfg, task)
  steps = _steps(tmp_path)
  assert len(steps) == 2
  for r in steps:
    assert r["rollout/routing_mismatch"] == 0.0, r
    assert r["rollout/logprob_abs_diff_max"] < 1e-4, r
  assert (task.abstract_batch(task.setup.model_cfg).routes is not None) == replay


@pytest.mark.long  # CI time; online replay, episodes' recorded experts and regrouping stay in the default run
def test_async_grpo_replays_the_behaviour_policys_experts(moe_policy, tmp_path):
  """With async_staleness 1 the rollout of step 2 was sampled by the policy before step 1's update: its experts
  (checkpointed with the in-flight rollout) are the behaviour policy's, which the current router partly disagrees
  with after an update."""
  cfg = dict(run_dir=str(tmp_path), model__path=moe_policy, train__steps=3, grpo__routing_replay=True,
             grpo__async_staleness=1, grpo__no_signal="update", optim__lr=3e-3, **QUIET)
  grpo_task.run(run_config("grpo", **cfg))
  steps = _steps(tmp_path)
  assert [r["rollout/policy_lag"] for r in steps] == [0.0, 1.0, 1.0]
  assert steps[0]["rollout/routing_mismatch"] == 0.0
  assert all(0.0 < r["rollout/routing_mismatch"] < 0.5 for r in steps[1:]), steps


@pytest.mark.long  # CI time; online replay, episodes' recorded experts and regrouping stay in the default run
def test_a_buffer_carries_the_experts_into_offline_grpo(moe_policy, tmp_path):
  rollout_task.run(run_config("rollout", run_dir=str(tmp_path / "rollout"), model__path=moe_policy,
                              rollout__prompts="synthetic:arith:train:8", rollout__prompts_per_batch=4, **QUIET))
  buffer = tmp_path / "rollout" / "buffer"
  from jalign.rl.buffer import read_all
  record = read_all(str(buffer))[0]
  length = len(record["prompt_ids"]) + len(record["response_ids"])
  assert record["route_layers"] == 4 and np.shape(record["routes"]) == (length, 4 * 2)
  assert (np.asarray(record["routes"])[:-1] >= 0).all() and (np.asarray(record["routes"])[-1] == -1).all()
  grpo_task.run(run_config("grpo", run_dir=str(tmp_path / "offline"), model__path=moe_policy, grpo__buffer=str(buffer),
                           grpo__routing_replay=True, grpo__eval_prompts="", grpo__prompts_per_step=2,
                           grpo__mini_batches=1, train__steps=2, grpo__no_signal="update", **QUIET))
  steps = _steps(tmp_path / "offline")
  assert len(steps) == 2 and steps[0]["rollout/routing_mismatch"] == 0.0

  dense_buffer = tmp_path / "dense"
  rollout_task.run(run_config("rollout", run_dir=str(dense_buffer), rollout__prompts="synthetic:arith:train:4",
                              rollout__prompts_per_batch=4, **QUIET))
  with pytest.raises(DataError, match="grpo.routing_replay replays the experts each token used in the rollout; "
                                      "these records have none"):
    grpo_task.run(run_config("grpo", run_dir=str(tmp_path / "bad"), model__path=moe_policy, train__steps=1,
                             grpo__buffer=str(dense_buffer / "buffer"), grpo__routing_replay=True,
                             grpo__eval_prompts="", **QUIET))


def test_replay_needs_experts(tmp_path):
  with pytest.raises(ConfigError, match=r"grpo.routing_replay: the policy \(llama\) has no experts"):
    grpo_task.run(run_config("grpo", run_dir=str(tmp_path / "a"), grpo__routing_replay=True, **QUIET))


@pytest.mark.long  # CI time: recorded experts in a run: test_online_grpo_replays_the_samplers_experts
def test_multi_turn_episodes_record_each_tokens_experts(moe_policy):
  """Three turns with the environment's ids between them, sampled with the prefix cache: every token of the episode
  keeps the experts that computed its keys and values (the first prompt's prefill, each turn's decode steps, the
  next call's prefill for a turn's last token and the observation; the held conversation's from its slot; the final
  token is never read). A teacher-forced fp32 forward over the whole episode routes every recorded token the same
  way."""
  from jalign.rl.agentic import agent
  from jalign.rl.agentic import env as env_lib
  lm = models.from_pretrained(moe_policy, dtype="float32")
  tok = load_tokenizer(moe_policy)
  again = tok.encode("2+2=", add_special_tokens=False)

  class ThreeTurns(env_lib.Env):
    def reset(self, record):
      self.turn = 0
      return [{"role": "user", "content": record["prompt"]}]

    def step(self, action_text, action_ids=None):
      self.turn += 1
      return env_lib.Step([] if self.turn == 3 else again, 0.0, self.turn == 3, {"turns": self.turn})

  sample = agent.sampler(lm, tok, jax.random.key(0), max_turn_tokens=6, temperature=1.0, pad_id=tok.pad_id,
                         record_routes=True)
  out = agent.rollout(ThreeTurns, tok, [{"prompt": "1+1="}, {"prompt": "3+4="}], 2, sample, max_turn_tokens=6,
                      max_tokens=lm.cfg.max_position_embeddings)
  L, k = len(lm.cfg.moe_layers), lm.cfg.experts_per_token
  assert [i["turns"] for i in out.info] == [3] * 4
  for e, routes in zip(out.episodes, out.routes):
    assert routes.shape == (len(e.ids), L, k)
    recorded = routes[:, 0, 0] >= 0  # all but the last token sampled (a truncated last turn's too)
    assert recorded[:-1].all() and not recorded[-1]
    ids = jnp.asarray([e.ids])
    _, _, own = lm.forward_routed(ids, jnp.ones_like(ids), route_ids=jnp.asarray(routes[None]).transpose(2, 0, 1, 3),
                                  replay=False)
    assert float(jnp.sum(own.mismatch_sum)) == 0.0 and float(jnp.sum(own.recorded)) == L * recorded.sum()


@pytest.mark.long  # CI time; online replay, episodes' recorded experts and regrouping stay in the default run
def test_grpo_on_episodes_replays_the_samplers_experts(moe_policy, tmp_path):
  """env.name with routing replay: the episodes' experts reach the update (mismatch 0 in fp32)."""
  cfg = run_config("grpo", run_dir=str(tmp_path), model__path=moe_policy, train__steps=2, grpo__routing_replay=True,
                   grpo__no_signal="update", grpo__eval_examples=0, env__name="answer", env__max_turns=2, **QUIET)
  task = grpo_task.task(cfg)
  grpo_task.loop.run(cfg, task)
  steps = _steps(tmp_path)
  assert len(steps) == 2 and task.abstract_batch(task.setup.model_cfg).routes is not None
  for r in steps:
    assert r["rollout/routing_mismatch"] == 0.0 and r["rollout/logprob_abs_diff_max"] < 1e-4, r


@pytest.mark.long  # CI time: recorded experts in a run: test_online_grpo_replays_the_samplers_experts
def test_regrouped_batches_keep_each_tokens_experts(moe_policy):
  """Groups of two sampling batches with different prompt widths (dynamic sampling's refill), selected and laid out
  as one update batch: every recorded token's experts are still the ones a forward over its row picks (fp32), and
  a bf16 forward that replays them uses exactly them."""
  lm = models.from_pretrained(moe_policy, dtype="float32")
  tok = load_tokenizer(moe_policy)
  spec = rollout.SamplingSection(max_new_tokens=6, num_samples=2)
  batches = []
  for b, texts in enumerate((["1+2=", "13+25="], ["100+200+300="])):
    prompts = [Prompt(i, tok.encode(t), t, None, "") for i, t in enumerate(texts)]
    s = rollout.sample(lm, tok, prompts, jax.random.key(b), spec, record_routes=True)
    batches.append(Groups(prompts=prompts, size=2, response=s.tokens, lengths=s.lengths,
                          scores=np.arange(len(s.tokens), dtype=np.float32), prompt_routes=s.prompt_routes,
                          response_routes=s.response_routes))
  groups = Groups.select(batches[::-1], 3)
  batch = jax.tree.map(jnp.asarray, RolloutBatch.of_groups(groups, tok.pad_id, routes=True))
  assert batch.routes.shape == batch.tokens.shape + (4, 2) and batch.routes.dtype == jnp.int16
  graphdef, params = nnx.split(lm)
  missed, choices = objective.routing_mismatch(graphdef, params, batch, batch.routes, replay=False)
  recorded = (np.asarray(batch.routes)[..., 0] >= 0).sum()
  assert float(missed) == 0.0 and float(choices) == recorded * 2

  bf16 = models.from_pretrained(moe_policy, dtype="bfloat16")
  _, routing = bf16.response_routed(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                                    response_len=batch.response.shape[1], routes_NxTxLxK=batch.routes)
  used = np.asarray(jnp.moveaxis(routing.ids_BxTxK, 0, 2))
  has = np.asarray(batch.routes)[..., :1] >= 0
  np.testing.assert_array_equal(np.where(has, used, -1), np.asarray(batch.routes))


def test_the_update_adds_the_router_terms_it_is_given(moe_policy):
  """GRPO's loss on an MoE policy: its moe/* metrics always, and coef x the load-balancing loss (per token, like the
  policy loss) only when model.router_aux_loss asks for it (RL's default is 0)."""
  from jalign.objectives import router
  lm = models.from_pretrained(moe_policy, dtype="float32")
  tok = load_tokenizer(moe_policy)
  prompts = [Prompt(i, tok.encode(t), t, None, "") for i, t in enumerate(["1+2=", "13+25="])]
  s = rollout.sample(lm, tok, prompts, jax.random.key(0), rollout.SamplingSection(max_new_tokens=6, num_samples=2))
  groups = Groups(prompts=prompts, size=2, response=s.tokens, lengths=s.lengths, scores=np.zeros(4, np.float32))
  batch = jax.tree.map(jnp.asarray, RolloutBatch.of_groups(groups, tok.pad_id)).replace(
      advantages=jnp.ones(s.tokens.shape, jnp.float32))
  graphdef, params = nnx.split(lm)
  out = {}
  for aux in (None, 0.5):
    cfg = objective.GrpoLossConfig(router=router.RouterLoss(aux, rl=True), kl_coef=0.0)
    out[aux] = objective.make_loss_fn(graphdef, cfg)(params, batch)
  (num0, den0, sums0), (num1, den1, sums1) = out[None], out[0.5]
  assert sums0["moe/aux_loss"] == sums1["moe/aux_loss"]  # the metric either way
  assert float(den0) == float(den1) > 0
  aux_loss = float(sums1["moe/aux_loss"]) / float(den1)
  assert 2.0 <= aux_loss <= 8.0  # k for a balanced router, up to E
  np.testing.assert_allclose(float(num1 - num0), 0.5 * aux_loss * float(den1), rtol=1e-4)


@pytest.mark.long  # CI time; online replay, episodes' recorded experts and regrouping stay in the default run
def test_expert_parallel_grpo_equals_the_fsdp_run(moe_policy, tmp_path):
  """The policy's 4 experts split over an `expert` axis of 4 (fsdp 2): sampling and the update exchange token
  copies by all-to-all, and the run equals the one whose 8 devices all hold every expert (fp32: the same samples,
  rewards and losses), with replay and the sampler-trainer agreement intact."""
  runs = {}
  for shape in ((1, 8, 1), (1, 2, 1, 4)):
    run_dir = tmp_path / "x".join(map(str, shape))
    cfg = run_config("grpo", run_dir=str(run_dir), model__path=moe_policy, train__steps=2, grpo__routing_replay=True,
                     grpo__no_signal="update", mesh__shape=shape, **QUIET)
    grpo_task.loop.run(cfg, grpo_task.task(cfg))
    runs[shape] = _steps(run_dir)
  fsdp, ep = runs.values()
  assert len(fsdp) == len(ep) == 2
  for a, b in zip(fsdp, ep):
    assert b["rollout/routing_mismatch"] == 0.0 and b["rollout/logprob_abs_diff_max"] < 1e-4, b
    for key in ("critic/score/mean", "response_length/mean"):
      assert b[key] == a[key], (key, a[key], b[key])
    np.testing.assert_allclose(b["actor/pg_loss"], a["actor/pg_loss"], rtol=1e-4, atol=1e-6)
