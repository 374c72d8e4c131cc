"""A trained reward model as the RL reward: rollout rewards equal transformers' sequence-classification scores of the
same prompt + completion ids (one model, or an ensemble's weighted sum); GRPO runs with it."""
import json
import os

import numpy as np
import pytest

from jalign.rl import buffer
from jalign.tasks import grpo, rollout
from jalign.tasks import rm as reward_task
from tests.configs_util import ROOT, run_config

PAIRS = os.path.join(ROOT, "jalign", "assets", "arith_prefs", "test.jsonl")
QUIET = dict(log__progress=False, log__tensorboard=False)


def _reward_model(tmp_path, members=()) -> str:
  """A 3-step reward model (run_dir/hf), or with `members` the ensemble (run_dir/ensemble)."""
  run_dir = str(tmp_path / "rm")
  reward_task.run(run_config("rm", run_dir=run_dir, data__train=PAIRS, data__eval="", train__steps=3,
                             rm__members=members, **QUIET))
  return os.path.join(run_dir, "ensemble" if members else "hf")


def _hf_scores(rm_dir: str, records: list[dict]) -> np.ndarray:
  import torch
  import transformers
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
  with torch.no_grad():
    return np.asarray([float(hf(input_ids=torch.tensor([list(r["prompt_ids"]) + list(r["response_ids"])])).logits[0, 0])
                       for r in records])


@pytest.mark.parametrize("ensemble", [False, True])
def test_rollout_rewards_equal_transformers_scores(tmp_path, ensemble):
  members = ({"train": PAIRS, "steps": 2, "weight": 0.5},) if ensemble else ()
  rm_dir = _reward_model(tmp_path, members)
  cfg = run_config("rollout", run_dir=str(tmp_path / "ro"), reward__weights=(), reward__model=rm_dir,
                   reward__model_weight=2.0, rollout__limit=8, rollout__prompts_per_batch=8)
  rollout.run(cfg)
  records = buffer.read_all(os.path.join(str(tmp_path / "ro"), "buffer"))
  assert len(records) == 8 * cfg.sampling.num_samples
  if ensemble:  # the members' scores, summed with their weights
    first, second = _hf_scores(os.path.join(rm_dir, "0"), records), _hf_scores(os.path.join(rm_dir, "1"), records)
    assert np.abs(first - second).max() > 1e-3
    theirs = first + 0.5 * second
  else:
    theirs = _hf_scores(rm_dir, records)
  np.testing.assert_allclose([r["reward"] for r in records], 2.0 * theirs, atol=2e-4)
  assert np.std(theirs) > 1e-4


def test_grpo_with_a_reward_model(tmp_path):
  rm_dir = _reward_model(tmp_path)
  run_dir = str(tmp_path / "grpo")
  final = grpo.run(run_config("grpo", run_dir=run_dir, reward__model=rm_dir, train__steps=2, **QUIET))
  assert np.isfinite(final["critic/rm_score/mean"])
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  assert any("critic/rm_score/mean" in r for r in rows)


def test_reward_config_errors(tmp_path):
  from jalign.core.errors import ConfigError
  with pytest.raises(ConfigError, match=r"config.reward: no reward configured"):
    run_config("grpo", reward__weights=())
  policy = os.path.join(ROOT, "jalign", "assets", "tiny_policy")
  with pytest.raises(ConfigError, match=r"is not a \*ForSequenceClassification reward model"):
    run_config("grpo", reward__model=policy)
  with pytest.raises(ConfigError, match=r"cannot read its config.json"):
    run_config("rollout", reward__model=str(tmp_path / "missing"))
  # an ensemble directory: a malformed reward_ensemble.json, a member that is missing or not a reward model
  ensemble = tmp_path / "ensemble"
  ensemble.mkdir()
  (ensemble / "reward_ensemble.json").write_text('{"members": [{"path": "0"}]}')
  with pytest.raises(ConfigError, match=r"reward_ensemble.json: expected \{\"members\": \[\{\"path\": DIR, \"weight\""):
    run_config("grpo", reward__model=str(ensemble))
  (ensemble / "reward_ensemble.json").write_text('{"members": [{"path": "0", "weight": 1.0}]}')
  with pytest.raises(ConfigError, match=r"member '.*/ensemble/0' is not an HF checkpoint directory"):
    run_config("grpo", reward__model=str(ensemble))
  os.symlink(policy, ensemble / "0")
  with pytest.raises(ConfigError, match=r"ensemble/0'.*is not a \*ForSequenceClassification reward model"):
    run_config("grpo", reward__model=str(ensemble))


def test_an_ensemble_is_not_a_starting_point_for_training(tmp_path):
  from jalign.core.errors import ConfigError
  rm_dir = _reward_model(tmp_path, ({"train": PAIRS, "steps": 2, "weight": 1.0},))
  for task, extra in (("rm", dict(rm__members=())), ("grpo", {})):
    with pytest.raises(ConfigError, match=r"ensemble' is a reward-model ensemble .*use one of its numbered member"):
      run_config(task, model__path=rm_dir, **extra)
