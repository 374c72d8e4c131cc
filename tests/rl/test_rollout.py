"""The offline rollout task: buffer contents, verl's parquet layout, resume after SIGKILL, bad prompts."""
import json
import os
import signal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jalign.data.prompts import PromptError
from jalign.rl import buffer
from tests import cli
from tests.configs_util import run_config


def _run(run_dir, *extra, env=None, check=True):
  return cli.run("rollout.py:tiny", run_dir, *extra, program=cli.FAULTY, env=env, check=check, timeout=300)


def test_buffer_contents(tmp_path):
  _run(tmp_path / "r", "--config.rollout.prompts_per_batch=32")
  records = buffer.read_all(str(tmp_path / "r" / "buffer"))
  assert len(records) == 64 * 4
  assert sorted({r["prompt_index"] for r in records}) == list(range(64))
  for r in records:
    assert len(r["response_ids"]) == len(r["behaviour_logprobs"]) > 0
    assert all(lp <= 0 for lp in r["behaviour_logprobs"])
    assert r["reward"] == float(r["completion"].strip() == f"#### {r['ground_truth']}")
  groups = {}
  for r in records:
    groups.setdefault(r["group_id"], []).append(r["sample"])
  assert all(sorted(s) == [0, 1, 2, 3] for s in groups.values())


def test_killed_rollout_completes_every_prompt_exactly_once(tmp_path):
  clean = tmp_path / "clean"
  _run(clean)
  killed = _run(tmp_path / "r", env={"KILL_AT_PART": "2"}, check=False)
  assert killed.returncode == -signal.SIGKILL
  parts = sorted(os.listdir(tmp_path / "r" / "buffer"))
  assert parts == ["part-000000.parquet", "part-000001.parquet"]
  _run(tmp_path / "r")
  got, want = buffer.read_all(str(tmp_path / "r" / "buffer")), buffer.read_all(str(clean / "buffer"))
  assert [(r["prompt_index"], r["sample"]) for r in got] == [(r["prompt_index"], r["sample"]) for r in want]
  assert [r["response_ids"] for r in got] == [r["response_ids"] for r in want]  # same keys per batch


def test_verl_parquet_layout_and_arrayrecord_output(tmp_path):
  rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
           "extra_info": {"index": i}} for i in range(6)]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
  _run(tmp_path / "r", f"--config.rollout.prompts={tmp_path}/train.parquet", "--config.rollout.format=arrayrecord",
       "--config.sampling.layout=no_fsdp")
  records = buffer.read_all(str(tmp_path / "r" / "buffer"))
  assert len(records) == 24 and {r["ground_truth"] for r in records} == {str(i + 1) for i in range(6)}
  assert records[0]["prompt"].endswith("What is 0 + 1?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 2 + 2?"}],
     r"prompts.jsonl:2: reward 'gsm8k' needs a ground truth"),
    ([{"prompt": "", "answer": "1"}], r"prompts.jsonl:1: empty prompt"),
    ([{"question": "x"}], r"prompts.jsonl:1: record has no 'prompt' field"),
    ([{"prompt": "What is " + "9 + " * 40 + "1?", "answer": "1"}], r"prompts.jsonl:1: prompt has \d+ tokens, more "
                                                                   r"than the allowed 48"),
])
def test_bad_prompts_name_the_record(tmp_path, rows, message):
  from jalign.rewards.verifiable import RewardError
  from jalign.tasks import rollout
  with open(tmp_path / "prompts.jsonl", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
  cfg = run_config("rollout", run_dir=str(tmp_path / "r"), rollout__prompts=str(tmp_path / "prompts.jsonl"))
  with pytest.raises((PromptError, RewardError), match=message):
    rollout.run(cfg)


def test_unknown_reward_is_a_config_error():
  from jalign.core.errors import ConfigError
  with pytest.raises(ConfigError, match=r"config.reward: unknown reward 'gsm9k'; available: boxed"):
    run_config("rollout", reward__weights=(("gsm9k", 1.0),))
