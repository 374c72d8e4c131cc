"""configs/recipes/*.py: each recipe's `smoke` size runs end to end on a real chat model (SmolLM2-135M-Instruct,
from ../shared/realdata) and real data read as it comes (GSM8K, HH-RLHF; MATH-style records written here)."""
import json
import math
import os

import pytest

from jalign.run import TASKS
from tests import realdata
from tests.configs_util import run_config
from tests.realdata import smollm2_hf  # noqa: F401  (the session fixture)

# MATH-format records ({problem, level, type, solution}); truths are the solutions' last boxed answers
MATH = [{"problem": "What is $2+3$?", "level": "Level 1", "type": "Prealgebra",
         "solution": "$2+3=\\boxed{5}$."},
        {"problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.", "level": "Level 1", "type": "Prealgebra",
         "solution": "The sum is $\\frac{3}{6}+\\frac{2}{6}=\\boxed{\\frac{5}{6}}$."},
        {"problem": "What is $7\\times 6$?", "level": "Level 1", "type": "Prealgebra",
         "solution": "$7\\times 6 = \\boxed{42}$."},
        {"problem": "Solve $x+4=10$.", "level": "Level 1", "type": "Algebra", "solution": "So $x=\\boxed{6}$."}]


def _data(name, tmp_path):
  gsm8k, hh = realdata.path("gsm8k/train.jsonl"), realdata.path("hh-rlhf/helpful-base_test.jsonl.gz")
  if name == "gsm8k_sft":
    return dict(data__train=f"{gsm8k}[:64]", data__eval=f"{gsm8k}[-16:]")
  if name == "gsm8k_grpo":
    return dict(grpo__prompts=f"{gsm8k}[:64]", grpo__eval_prompts=f"{gsm8k}[-8:]")
  if name == "math_grpo":
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH))
    return dict(grpo__prompts=str(path), grpo__eval_prompts=str(path))
  return dict(data__train=f"{hh}[:64]", data__eval=f"{hh}[-16:]")


@pytest.mark.slow
def test_recipe_smoke_runs_on_smollm2(smollm2_hf, tmp_path):  # noqa: F811
  """One test, the recipes in turn: each holds 9-13 GB at its peak on a CPU host, too much for two at once."""
  model_dir, _ = smollm2_hf
  for name in ("gsm8k_sft", "gsm8k_grpo", "math_grpo", "hh_rm", "hh_dpo"):
    run_dir = tmp_path / name
    cfg = run_config(f"recipes/{name}", "smoke", model__path=model_dir, run_dir=str(run_dir), log__progress=False,
                     **_data(name, tmp_path))
    final = TASKS[cfg.task](cfg)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    losses = [r[k] for r in rows for k in ("train/loss", "actor/pg_loss") if k in r]
    assert all(math.isfinite(v) for v in losses), name
    if cfg.task == "grpo":
      assert "critic/score/mean" in final and any("eval/accuracy" in r for r in rows), name
    else:
      assert len(losses) == cfg.train.steps and "eval/loss" in final, name
    assert os.path.exists(run_dir / "hf" / "config.json"), name


def test_recipes_reject_unknown_args():
  for name in ("gsm8k_sft", "gsm8k_grpo", "math_grpo", "hh_rm", "hh_dpo"):
    with pytest.raises(ValueError, match="unknown"):
      run_config(f"recipes/{name}", "huge")
  for variant in ("drgrpo", "dapo", "dapo,smoke"):
    cfg = run_config("recipes/gsm8k_grpo", variant, model__path="m", grpo__prompts="p.jsonl")
    assert cfg.grpo.kl_coef == 0.0
