"""configs/pipeline.py:tiny end to end (SFT -> RM -> GRPO -> DPO, evaluation, report), and the same pipeline killed
in its third stage: rerun with the same command it does not rerun the first two stages, continues GRPO from its
checkpoint and ends with the same weights and evaluation as the uninterrupted run."""
import json
import os

import pytest

from jalign.core.errors import ConfigError
from jalign.eval import report
from jalign.tasks import chain as pipeline
from tests import cli
from tests.configs_util import config_dict

STAGES = ("0_base", "1_sft", "2_rm", "3_grpo", "4_dpo")


def _pipeline(run_dir, env=None, faulty=False):
  return cli.run("pipeline.py:tiny", run_dir, chain=True, program=cli.FAULTY if faulty else "jalign.run", env=env,
                 timeout=900)


def _read(path):
  with open(path, "rb") as f:
    return f.read()


def test_pipeline_runs_every_stage_and_resumes_inside_the_third(tmp_path):
  straight, killed = tmp_path / "straight", tmp_path / "killed"
  proc = _pipeline(straight)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for stage in STAGES:
    assert (straight / stage / "stage.json").exists(), stage
  text = (straight / "report.md").read_text()
  final = json.loads((straight / "4_dpo" / "stage.json").read_text())["eval"]
  assert f"| 4_dpo | {final['eval/accuracy']:.4f} | {final['eval/pass@1']:.4f} | {final['eval/win_rate']:.4f} |" in text
  for stage in STAGES[1:]:
    assert (straight / "plots" / f"{stage}.png").read_bytes()[:4] == b"\x89PNG"
  rows = [json.loads(line) for line in (straight / "3_grpo" / "metrics.jsonl").read_text().splitlines()]
  assert any("critic/rm_score/mean" in r for r in rows)  # the RL stage is rewarded by the pipeline's RM too

  proc = _pipeline(killed, env={"KILL_AFTER_SAVE": "2", "KILL_RUN_DIR": "3_grpo"}, faulty=True)
  assert proc.returncode == -9, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert (killed / "2_rm" / "stage.json").exists() and not (killed / "3_grpo" / "stage.json").exists()
  before = {s: os.stat(killed / s / "stage.json").st_mtime_ns for s in STAGES[:3]}
  proc = _pipeline(killed)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert "stage 1_sft: finished earlier" in proc.stdout and "stage 2_rm: finished earlier" in proc.stdout
  assert "resumed from" in proc.stdout and str(killed / "3_grpo" / "checkpoints" / "2") in proc.stdout
  assert {s: os.stat(killed / s / "stage.json").st_mtime_ns for s in STAGES[:3]} == before
  for stage in ("3_grpo", "4_dpo"):
    assert _read(killed / stage / "hf" / "model.safetensors") == _read(straight / stage / "hf" / "model.safetensors")
    assert (json.loads((killed / stage / "stage.json").read_text())["eval"]
            == json.loads((straight / stage / "stage.json").read_text())["eval"])
  assert report.stages_of(str(killed)) == [(s, str(killed / s)) for s in STAGES]


@pytest.mark.parametrize("overrides,message", [
    (dict(order=("sft", "rlhf")), "config.order=.*stages must be among sft, rm, grpo, ppo, dpo"),
    (dict(stages__grpo__optim__lr=-1.0), "config.stages.grpo.optim.lr=-1.0: must be positive"),
    (dict(order=("rm", "rm")), "at most one reward-model stage"),
    (dict(colour="red"), "config.colour: unknown key"),
])
def test_bad_pipeline_configs(overrides, message):
  with pytest.raises(ConfigError, match=message):
    pipeline.stage_configs(config_dict("pipeline", **overrides), 8)
