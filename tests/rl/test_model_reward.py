"""A trained reward model as the RL reward: rollout rewards equal transformers' sequence-classification scores of the
same prompt + completion ids; GRPO runs with it."""
import json
import os

import numpy as np

from jalign.rl import buffer
from jalign.train import grpo, reward as reward_task, rollout
from tests.configs_util import ROOT, run_config

PAIRS = os.path.join(ROOT, "jalign", "assets", "arith_prefs", "test.jsonl")
QUIET = dict(log__progress=False, log__tensorboard=False)


def _reward_model(tmp_path) -> str:
  run_dir = str(tmp_path / "rm")
  reward_task.run(run_config("rm", run_dir=run_dir, data__train=PAIRS, data__eval="", train__steps=3, **QUIET))
  return os.path.join(run_dir, "hf")


def test_rollout_rewards_equal_transformers_scores(tmp_path):
  import torch
  import transformers

  rm_dir = _reward_model(tmp_path)
  cfg = run_config("rollout", run_dir=str(tmp_path / "ro"), reward__weights=(), reward__model=rm_dir,
                   reward__model_weight=2.0, rollout__limit=8, rollout__prompts_per_batch=8)
  rollout.run(cfg)
  records = buffer.read_all(os.path.join(str(tmp_path / "ro"), "buffer"))
  assert len(records) == 8 * cfg.sampling.num_samples
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
  with torch.no_grad():
    theirs = [float(hf(input_ids=torch.tensor([list(r["prompt_ids"]) + list(r["response_ids"])])).logits[0, 0])
              for r in records]
  np.testing.assert_allclose([r["reward"] for r in records], 2.0 * np.asarray(theirs), atol=2e-4)
  assert np.std(theirs) > 1e-4


def test_grpo_with_a_reward_model(tmp_path):
  rm_dir = _reward_model(tmp_path)
  run_dir = str(tmp_path / "grpo")
  final = grpo.run(run_config("grpo", run_dir=run_dir, reward__model=rm_dir, train__steps=2, **QUIET))
  assert np.isfinite(final["critic/rm_score/mean"])
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert any("critic/rm_score/mean" in r for r in rows)


def test_reward_config_errors(tmp_path):
  import pytest

  from jalign.config import ConfigError
  with pytest.raises(ConfigError, match=r"config.reward: no reward configured"):
    run_config("grpo", reward__weights=())
  policy = os.path.join(ROOT, "jalign", "assets", "tiny_policy")
  with pytest.raises(ConfigError, match=r"is not a \*ForSequenceClassification reward model"):
    run_config("grpo", reward__model=policy)
  with pytest.raises(ConfigError, match=r"cannot read its config.json"):
    run_config("rollout", reward__model=str(tmp_path / "missing"))
