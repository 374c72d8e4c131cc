"""Multi-turn rollouts (jalign.rl.agentic.agent): episodes sampled turn by turn in batches, tools answering between turns,
one row per episode whose loss mask is exactly the model's tokens, truncation at the turn and episode budgets, and
the real sampler driving the shipped tiny policy."""
import json
import os

import jax
import numpy as np

from jalign import models
from jalign.data.sources import open_source
from jalign.rl.agentic import agent
from jalign.rl.agentic import env as env_lib
from jalign.tokenizers import tokenizer
from tests import cli
from tests.configs_util import ROOT
from tests.realdata import path

RECORDS = [{"prompt": "What is 1234 * 5678?", "answer": "7006652"}, {"prompt": "What is 99 * 101?", "answer": "9999"}]


def _scripted(tok, *, final_answers, cut_at=None):
  """A stand-in model: first a calculator call on the prompt's expression, then `final_answers[prompt]`; every token
  at log-prob -0.5. `cut_at`: turns longer than this stop without their end-of-turn token."""
  def sample(rows):
    out = []
    for ids in rows:
      text = tok.decode(ids, skip_special_tokens=False)
      question = next(r["prompt"] for r in RECORDS if r["prompt"] in text)
      if "<tool_response>" not in text:
        call = {"name": "calculator", "arguments": {"expression": question.split("is ")[1].rstrip("?")}}
        turn = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
      else:
        turn = f"#### {final_answers[question]}"
      ids = tok.encode(turn, add_special_tokens=False) + [tok.eos_id]
      out.append(ids[:cut_at] if cut_at else ids)
    width = max(map(len, out))
    tokens = np.array([o + [tok.pad_id] * (width - len(o)) for o in out], np.int32)
    logp = np.where(np.arange(width)[None] < np.array([len(o) for o in out])[:, None], -0.5, 0.0)
    return tokens, logp.astype(np.float32), np.array([len(o) for o in out], np.int32)
  return sample


def test_episodes_with_a_tool_call_then_an_answer():
  tok = tokenizer.load(path("tokenizers/qwen3"))
  assert tok.eos_id == tok.tk.token_to_id("<|im_end|>")
  answers = {RECORDS[0]["prompt"]: "7006652", RECORDS[1]["prompt"]: "9998"}  # the second answer is wrong
  make = lambda: env_lib.make("calculator", max_turns=3)  # noqa: E731
  out = agent.rollout(make, tok, RECORDS, 2, _scripted(tok, final_answers=answers), max_turn_tokens=64,
                      max_tokens=4096)
  assert out.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]
  assert [i["turns"] for i in out.info] == [2] * 4 and [i["tool_calls"] for i in out.info] == [1] * 4
  for k, ep in enumerate(out.episodes):
    row = out.response[k, :out.lengths[k]].tolist()
    assert row == ep.response_ids and out.prompt_ids[k] + row == ep.ids
    text = tok.decode(row, skip_special_tokens=False)
    assert "<tool_response>\n" + ("7006652" if k < 2 else "9999") + "\n</tool_response>" in text
    model = [t for t, m in zip(row, out.loss_mask[k]) if m]
    assert tok.decode(model, skip_special_tokens=False).count("<|im_end|>") == 2  # two turns, each closed
    assert np.all((out.logprobs[k] == -0.5) == (out.loss_mask[k] == 1))
    assert np.all(out.loss_mask[k, out.lengths[k]:] == 0) and np.all(out.response[k, out.lengths[k]:] == tok.pad_id)
  m = out.metrics()
  assert m["agent/turns/mean"] == 2.0 and m["agent/tool_calls/mean"] == 1.0 and m["agent/truncated_fraction"] == 0.0
  assert m["agent/episode_tokens/mean"] == float(np.mean(out.lengths))


def test_truncation_by_turn_and_episode_budgets():
  tok = tokenizer.load(path("tokenizers/qwen3"))
  answers = {r["prompt"]: r["answer"] for r in RECORDS}
  make = lambda: env_lib.make("calculator", max_turns=3)  # noqa: E731
  cut = agent.rollout(make, tok, RECORDS, 1, _scripted(tok, final_answers=answers, cut_at=5), max_turn_tokens=5,
                      max_tokens=4096)
  assert cut.rewards.tolist() == [0.0, 0.0] and all(i["truncated"] for i in cut.info)
  assert cut.lengths.tolist() == [5, 5] and cut.loss_mask.sum() == 10
  prompt = len(cut.prompt_ids[0])
  short = agent.rollout(make, tok, RECORDS, 1, _scripted(tok, final_answers=answers), max_turn_tokens=64,
                        max_tokens=prompt + 64 + 10)  # room for one turn, not for the observation and another
  assert short.rewards.tolist() == [0.0, 0.0] and all(i["truncated"] and i["turns"] == 1 for i in short.info)
  none = agent.rollout(make, tok, RECORDS, 1, _scripted(tok, final_answers=answers), max_turn_tokens=64,
                       max_tokens=prompt)
  assert none.lengths.tolist() == [0, 0] and all(i["truncated"] and i["turns"] == 0 for i in none.info)


def test_the_sampler_drives_the_tiny_policy():
  """The shipped policy knows no tools (and its context has no room for their description): with none offered, one
  turn per episode, closed by its end-of-turn token, scored by the verifier; the sampler's log-probs sit on exactly
  the model's tokens."""
  lm = models.from_pretrained(os.path.join(ROOT, "jalign", "assets", "tiny_policy"))
  tok = tokenizer.load(os.path.join(ROOT, "jalign", "assets", "arith_tokenizer"))
  source = open_source("synthetic:arith:test:8")
  records = [source[i] for i in range(8)]
  sample = agent.sampler(lm, tok, jax.random.key(0), max_turn_tokens=16, temperature=1.0, pad_id=tok.pad_id)
  out = agent.rollout(lambda: env_lib.ToolEnv({}, reward="gsm8k", max_turns=2), tok, records, 2, sample,
                      max_turn_tokens=16, max_tokens=lm.cfg.max_position_embeddings)
  assert [i["turns"] for i in out.info] == [1] * 16 and out.metrics()["agent/tool_calls/mean"] == 0.0
  from jalign.rewards.verifiable import REGISTRY, Batch
  for k in range(16):
    assert out.response[k, out.lengths[k] - 1] == tok.eos_id and not out.info[k]["truncated"]
    text = tok.decode(out.response[k, :out.lengths[k] - 1])
    assert out.rewards[k] == REGISTRY["gsm8k"](Batch([text], [records[k // 2]["answer"]], np.ones(1)))[0]
    assert np.all(out.loss_mask[k, :out.lengths[k]] == 1) and np.all(out.logprobs[k, :out.lengths[k]] <= 0)
  assert 0.0 < out.rewards.mean() < 1.0


def test_grpo_trains_on_episodes(tmp_path):
  """env.name: the tiny GRPO config on one-answer episodes ("answer": no tools, the shipped policy knows none) runs
  end to end and logs the agent metrics, and a step's update batch masks exactly the model's tokens."""
  cli.run("grpo.py:tiny", tmp_path, "--config.train.steps=2", "--config.train.log_every=1",
          "--config.grpo.eval_examples=0", "--config.env.name=answer", "--config.env.max_turns=2", check=True)
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  steps = [r for r in rows if "agent/turns/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert r["agent/turns/mean"] == 1.0 and r["agent/tool_calls/mean"] == 0.0 and r["agent/truncated_fraction"] == 0.0
    assert r["rollout/logprob_abs_diff_max"] < 1e-4 and 0 < r["agent/episode_tokens/mean"] <= 16
  assert any("actor/pg_loss" in r for r in steps) and 0 < np.mean([r["critic/score/mean"] for r in steps]) < 1


def test_update_batch_masks_the_observations():
  from jalign.data.prompts import Prompt
  from jalign.rl.batch import RolloutBatch
  from jalign.rl.groups import Groups
  response = np.array([[5, 6, 7, 8, 9, 0], [5, 6, 0, 0, 0, 0]])
  loss_mask = np.array([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
  groups = Groups(prompts=[Prompt(0, [1, 2, 3], "", "4", "x")], size=2, response=response, lengths=np.array([5, 2]),
                  scores=np.zeros(2), loss_mask=loss_mask)
  rows = RolloutBatch.of_groups(groups, 0)
  assert rows.response_mask.tolist() == loss_mask.tolist()
  assert rows.segment_ids[:, -6:].tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]  # observations are read


def test_gae_over_an_episode_equals_gae_over_the_models_tokens_alone():
  """Episodes -> update batch -> PPO's advantages (rl.stage.advantages with a critic): the observations between the
  model's turns neither bootstrap nor accumulate, so each episode's GAE equals the textbook recursion (Schulman et
  al. 2016, NumPy here) run over its model tokens with the observations cut out, and is 0 on the observations. The
  outcome sits on the last model token."""

  import jax.numpy as jnp

  from jalign.data.prompts import Prompt
  from jalign.losses.advantages import AdvantageSection
  from jalign.rl.batch import RolloutBatch
  from jalign.rl.groups import Groups
  from jalign.rl.stage import advantages
  tok = tokenizer.load(path("tokenizers/qwen3"))
  answers = {RECORDS[0]["prompt"]: "7006652", RECORDS[1]["prompt"]: "9998"}
  out = agent.rollout(lambda: env_lib.make("calculator", max_turns=3), tok, RECORDS, 2,
                      _scripted(tok, final_answers=answers), max_turn_tokens=64, max_tokens=4096)
  prompts = [Prompt(i, out.prompt_ids[2 * i], "", r["answer"], "x") for i, r in enumerate(RECORDS)]
  groups = Groups(prompts=prompts, size=2, response=out.response, lengths=out.lengths, scores=out.rewards,
                  loss_mask=out.loss_mask)
  rows = RolloutBatch.of_groups(groups, tok.pad_id)
  mask = rows.response_mask
  values = np.random.RandomState(0).randn(*mask.shape).astype(np.float32)

  class Critic:  # a fixed value function: the test is of the advantage path, not of the critic's training
    def values(self, batch):
      return jnp.asarray(values)

  batch, _, _ = advantages(AdvantageSection(estimator="gae", gamma=0.9, lam=0.8), jax.tree.map(jnp.asarray, rows),
                           groups, critic=Critic(), reward_kl=None, dynamic_sampling=False,
                           sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  adv, returns = np.asarray(batch.advantages), np.asarray(batch.returns)
  raw = []
  for k in range(len(out.rewards)):
    idx = np.flatnonzero(mask[k])
    assert len(idx) < out.lengths[k]  # the episode has observation tokens inside its response
    r = np.zeros(len(idx))
    r[-1] = out.rewards[k]
    v, last, gae = values[k, idx], 0.0, np.zeros(len(idx))
    for t in reversed(range(len(idx))):
      next_v = v[t + 1] if t + 1 < len(idx) else 0.0
      last = r[t] + 0.9 * next_v - v[t] + 0.9 * 0.8 * last
      gae[t] = last
    raw.append(gae)
    np.testing.assert_allclose(returns[k, idx], gae + v, atol=1e-5)
  flat = np.concatenate(raw)
  whitened = (flat - flat.mean()) / np.sqrt(flat.var(ddof=1) + 1e-8)  # verl masked_whiten: over every model token
  np.testing.assert_allclose(np.concatenate([adv[k, np.flatnonzero(mask[k])] for k in range(len(raw))]), whitened,
                             atol=1e-4)


def test_per_turn_rewards_and_environments_that_send_ids():
  """A multi-step reward: each turn's reward sits on that turn's last token and the episode's return is their sum;
  an environment may answer with token ids of its own (appended as they are, out of the loss)."""
  tok = tokenizer.load(path("tokenizers/qwen3"))
  think = tok.encode("\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)

  class Counting(env_lib.Env):  # rewards each turn 0.25 x its number; three turns; observations as ids
    def reset(self, record):
      self.turn = 0
      return [{"role": "user", "content": record["prompt"]}]

    def step(self, action_text, action_ids=None):
      self.turn += 1
      assert action_ids[-1] == tok.eos_id and tok.decode(action_ids[:-1]) == action_text
      done = self.turn == 3
      return env_lib.Step([] if done else think, 0.25 * self.turn, done, {"turns": self.turn})

  def sample(rows):
    ids = tok.encode("ok", add_special_tokens=False) + [tok.eos_id]
    return (np.array([ids] * len(rows), np.int32), np.full((len(rows), len(ids)), -0.5, np.float32),
            np.array([len(ids)] * len(rows), np.int32))

  out = agent.rollout(Counting, tok, RECORDS[:1], 2, sample, max_turn_tokens=8, max_tokens=512)
  assert out.rewards.tolist() == [1.5, 1.5]
  ends = np.flatnonzero(out.response[0] == tok.eos_id)  # the model's turns end with <|im_end|>, as do observations
  model_ends = [e for e in ends if out.loss_mask[0, e]]
  assert len(model_ends) == 3 and out.token_rewards[0, model_ends].tolist() == [0.25, 0.5, 0.75]
  assert out.token_rewards[0].sum() == 1.5 and np.count_nonzero(out.token_rewards[0]) == 3
  row = out.response[0, :out.lengths[0]].tolist()
  ok = tok.encode("ok", add_special_tokens=False) + [tok.eos_id]
  assert row == ok + think + ok + think + ok  # the environment's ids as it sent them, between the model's turns
  assert out.loss_mask[0, :len(row)].tolist() == [1] * len(ok) + [0] * len(think) + [1] * len(ok) + \
      [0] * len(think) + [1] * len(ok)


def test_failed_calls_are_penalised_on_their_turn():
  env = env_lib.make("calculator", reward="gsm8k", error_reward=-0.1)
  env.reset({"prompt": "What is 2 * 3?", "answer": "6"})
  assert env.step("<tool_call>{oops</tool_call>").reward == -0.1
  assert env.step("<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2*3\"}}\n</tool_call>"
                  ).reward == 0.0
  assert env.step("#### 6").reward == 1.0
