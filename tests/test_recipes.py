"""configs/recipes/*.py: each recipe's `smoke` size runs end to end on a real chat model (SmolLM2-135M-Instruct,
from ../shared/realdata) and real data read as it comes (GSM8K, HH-RLHF; MATH-style records written here)."""
import json
import math
import os

import pytest

from tests import cli, realdata
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
  # 16 new tokens rarely reach an answer, so the groups carry no signal: run the update anyway (no_signal=update),
  # so the smoke run goes through every part of a step
  if name in ("gsm8k_grpo", "gsm8k_tools"):
    return dict(grpo__prompts=f"{gsm8k}[:64]", grpo__eval_prompts=f"{gsm8k}[-8:]", grpo__no_signal="update")
  if name == "math_grpo":
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in MATH))
    return dict(grpo__prompts=str(path), grpo__eval_prompts=str(path), grpo__no_signal="update")
  return dict(data__train=f"{hh}[:64]", data__eval=f"{hh}[-16:]")


def _flags(overrides: dict) -> list[str]:
  return [f"--config.{k.replace('__', '.')}={v}" for k, v in overrides.items()]


RECIPES = ("gsm8k_sft", "gsm8k_grpo", "gsm8k_tools", "math_grpo", "hh_rm", "hh_dpo")
# The recipes' real-model runs (and the distillation recipe's four) take some 22 minutes of the suite's 2 cores and
# run with `-m long` (CI time); the default run checks SmolLM2 itself against transformers (tests/models).
DEFAULT_RUN = ()


@pytest.mark.parametrize("name", [n if n in DEFAULT_RUN else pytest.param(n, marks=pytest.mark.long) for n in RECIPES])
def test_recipe_smoke_runs_on_smollm2(smollm2_hf, tmp_path, name):  # noqa: F811
  """Each recipe as a user runs it (`python -m jalign.run`, one CPU device), a test each so the suite's workers
  share them (a real model's run holds 4-5 GB at its peak on a CPU host: two at once fit). hh_dpo starts from the
  .gguf file itself, its tokenizer and chat template included."""
  model_dir, _ = smollm2_hf
  run_dir = tmp_path / name
  model = realdata.path(realdata.SMOLLM2_GGUF) if name == "hh_dpo" else model_dir
  cli.run(f"recipes/{name}.py:smoke", run_dir, f"--config.model.path={model}", *_flags(_data(name, tmp_path)),
          one_device=True, check=True, timeout=900)
  rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  losses = [r[k] for r in rows for k in ("train/loss", "actor/pg_loss") if k in r]
  assert losses and all(math.isfinite(v) for v in losses), name
  if name == "gsm8k_tools":  # episodes of the calculator environment, scored with and without the tool
    assert all("agent/turns/mean" in r and "agent/truncated_fraction" in r for r in rows if "actor/pg_loss" in r)
    assert any("eval/accuracy_no_tools" in r for r in rows)
  if "grpo" in name or "tools" in name:
    assert all("actor/no_signal" in r for r in rows if "actor/pg_loss" in r) and len(losses) == 2, name
    assert any("eval/accuracy" in r for r in rows), name
  else:
    assert len(losses) == 2 and any("eval/loss" in r for r in rows), name
  assert os.path.exists(run_dir / "hf" / "config.json") and os.path.exists(run_dir / "hf" / "tokenizer.json"), name


@pytest.mark.long
def test_distill_recipe_on_smollm2_taught_by_the_sft_recipe(smollm2_hf, tmp_path):  # noqa: F811
  """gsm8k_distill in each mode at smoke size: SmolLM2 distilled from SmolLM2 after the GSM8K SFT recipe (its smoke
  size: the teacher shares the tokenizer and differs a little), on GSM8K as it comes; one test, one teacher."""
  model_dir, _ = smollm2_hf
  cli.run("recipes/gsm8k_sft.py:smoke", tmp_path / "sft", f"--config.model.path={model_dir}",
          *_flags(_data("gsm8k_sft", tmp_path)), one_device=True, check=True, timeout=900)
  teacher = tmp_path / "sft" / "hf"
  for mode, data in (("on_policy", _data("gsm8k_grpo", tmp_path)), ("gkd", _data("gsm8k_sft", tmp_path)),
                     ("offline", _data("gsm8k_sft", tmp_path))):
    run_dir = tmp_path / mode
    cli.run(f"recipes/gsm8k_distill.py:{mode},smoke", run_dir, f"--config.model.path={model_dir}",
            f"--config.distill.teacher={teacher}", *_flags(data), one_device=True, check=True, timeout=900)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    key = "actor/kl_loss" if mode == "on_policy" else "distill/divergence"
    values = [r[key] for r in rows if key in r]
    assert len(values) == 2 and all(math.isfinite(v) for v in values), (mode, values)
    assert os.path.exists(run_dir / "hf" / "model.safetensors"), mode


def test_recipes_reject_unknown_args():
  for name in RECIPES + ("gsm8k_distill",):
    with pytest.raises(ValueError, match="unknown"):
      run_config(f"recipes/{name}", "huge")
  for variant in ("drgrpo", "dapo", "dapo,smoke"):
    cfg = run_config("recipes/gsm8k_grpo", variant, model__path="m", grpo__prompts="p.jsonl")
    assert cfg.kl.coef == 0.0
