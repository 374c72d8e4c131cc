"""The tool-use demonstrations (jalign.rl.agentic.traces) and the demo they warm-start (configs/agent.py): the shipped
traces are what the command regenerates, each one is solved, SFT trains exactly the tokens a rollout of the same
conversation produces, and the tiny demo runs end to end with the agent metrics and both accuracies."""
import json
import os

import numpy as np
import pytest

import jalign
from jalign.core.errors import DataError
from jalign.data import sft, synthetic
from jalign.rl.agentic import env as env_lib
from jalign.rl.agentic import traces
from jalign.rl.agentic.episode import Episode
from jalign.tokenizers import tokenizer
from tests import cli

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")
SHIPPED = os.path.join(ASSETS, "agent_traces", "train.jsonl")


def _env():
  return env_lib.make("calculator", reward="gsm8k", fmt="compact")


def test_the_shipped_traces_are_what_the_command_writes(tmp_path):
  tok = tokenizer.load(os.path.join(ASSETS, "tiny_policy"))
  out = tmp_path / "train.jsonl"
  assert traces.write(str(out), tok, _env(), "synthetic:mul:train:1280", direct=256) == 1280
  assert out.read_text() == open(SHIPPED, encoding="utf-8").read()
  rows = [json.loads(line) for line in open(SHIPPED, encoding="utf-8")]
  tooled = [r for r in rows if r["messages"][0]["role"] == "system"]
  assert len(tooled) == 1024 and len(rows) - len(tooled) == 256
  for r in tooled[:50]:  # the call holds the prompt's operands, the answer the exact product
    system, user, call, result, answer = r["messages"]
    a, b = user["content"].removeprefix("What is ").rstrip("?").split(" * ")
    assert call["content"] == f"<<{a}*{b}>>" and result["content"] == str(int(a) * int(b))
    assert answer["content"] == f"#### {int(a) * int(b)}"


def test_sft_trains_the_tokens_a_rollout_of_the_trace_produces():
  """Token in, token out, both ways: a trace encoded for SFT (the whole conversation rendered, loss on assistant
  turns) equals the episode a rollout builds from the same turns (the prompt rendered, the model's ids appended,
  the observations' ids from the template), ids and loss mask alike."""
  tok = tokenizer.load(os.path.join(ASSETS, "tiny_policy"))
  for line in open(SHIPPED, encoding="utf-8").readlines()[:20]:
    messages = json.loads(line)["messages"]
    encoded = sft.encode({"messages": messages}, tok, max_length=128)
    episode = Episode(tok, messages[:2])
    for m in messages[2:]:
      if m["role"] == "assistant":
        episode.add_model_turn(tok.encode(m["content"], add_special_tokens=False) + [tok.eos_id], m["content"])
      else:
        episode.add_observation([m])
    n = len(episode.ids)
    assert encoded["tokens"].tolist()[:n] == episode.ids
    # The one difference: SFT's span of an assistant turn runs to the end of its rendering, so it also learns the
    # template's newline after <|im_end|>, which a rollout, stopping at <|im_end|>, never samples.
    ids, sft_mask = encoded["tokens"].tolist(), encoded["loss_mask"].tolist()
    differ = [i for i in range(n) if sft_mask[i] != episode.loss_mask[i]]
    assert all(sft_mask[i] == 1 and ids[i - 1] == tok.eos_id and tok.decode([ids[i]]) == "\n" for i in differ)
    assert len(differ) == sum(m["role"] == "assistant" for m in messages[:-1])
    assert tok.decode(encoded["tokens"][n:].tolist(), skip_special_tokens=False).strip() == ""
    assert n <= 100  # an episode fits the tiny policy's 128-token context with room for sampling


def test_the_expert_is_checked_against_the_answer():
  tok = tokenizer.load(os.path.join(ASSETS, "tiny_policy"))
  record = synthetic.mul_records("train", 1)[0]
  assert traces.expert_trace(tok, _env(), record)["messages"][-1]["content"] == f"#### {record['answer']}"
  with pytest.raises(DataError, match="scores 0.0, not 1"):
    traces.expert_trace(tok, _env(), {**record, "answer": "7"}, "train.jsonl:1")
  with pytest.raises(DataError, match="train.jsonl:1: the expert calls calculator with the record's 'expression'"):
    traces.expert_trace(tok, _env(), {"prompt": "What is 2 * 3?", "answer": "6"}, "train.jsonl:1")


def test_mul_task_is_held_out_and_beyond_the_tiny_policy():
  train, test = synthetic.mul_records("train", 2000), synthetic.mul_records("test")
  assert len(test) == 500 and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
  assert all(len(r["answer"]) >= 7 and int(r["answer"]) == eval(r["expression"]) for r in test)  # noqa: S307


@pytest.mark.long  # CI time: GRPO on calculator episodes: tests/rl/test_agent.py::test_grpo_trains_on_episodes
def test_agent_demo_tiny_runs_and_logs_the_agent_metrics(tmp_path):
  """configs/agent.py:tiny: SFT on the traces, then GRPO on calculator episodes; the agent metrics every step and
  the held-out accuracy with and without tools, before and after GRPO."""
  proc = cli.run("agent.py:tiny", tmp_path, chain=True, one_device=True, check=True, timeout=900)
  rows = [json.loads(line) for line in open(tmp_path / "2_grpo" / "metrics.jsonl")]
  steps = [r for r in rows if "agent/turns/mean" in r]
  assert [r["step"] for r in steps] == [1, 2]
  for r in steps:
    assert {"agent/tool_calls/mean", "agent/tool_errors/mean", "agent/episode_tokens/mean",
            "agent/truncated_fraction", "rollout/logprob_abs_diff_max"} <= set(r)
    assert 1 <= r["agent/turns/mean"] <= 3
  assert np.mean([r["agent/tool_calls/mean"] for r in steps]) > 0.5  # the warm start calls the tool
  final = rows[-1]
  for key in ("eval/accuracy", "eval/accuracy_no_tools", "eval/accuracy_initial", "eval/accuracy_no_tools_initial"):
    assert 0.0 <= final[key] <= 1.0, key
  assert "with tools" in proc.stdout and "without" in proc.stdout
  assert np.isfinite(final["eval/accuracy"])
