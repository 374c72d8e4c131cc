"""The documentation stays true: the config reference is generated from the section dataclasses, every logged metric
is in the glossary, and every task page's commands run at smoke size."""
import os
import re
import shlex
import subprocess
import sys

import pytest

from jalign import config
from tests.configs_util import ROOT


def test_config_reference_is_current():
  """docs/config.md is what `python -m jalign.config` writes now (rerun it after changing a section)."""
  with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
    assert f.read() == config.reference_page(), "docs/config.md is stale: python -m jalign.config > docs/config.md"


METRIC = re.compile(r"\"((?:actor|critic|eval|train|rollout|perf|timing_s|data|mismatch|monitor|agent|response_length|"
                    r"rewards|logps|rm|distill|moe)/[A-Za-z0-9_/@]+)\"")


def test_every_logged_metric_is_in_the_glossary():
  """Each metric key written in jalign/ is explained in docs/metrics.md."""
  keys = set()
  for root, _, names in os.walk(os.path.join(ROOT, "jalign")):
    for name in names:
      if name.endswith(".py"):
        keys |= set(METRIC.findall(open(os.path.join(root, name), encoding="utf-8").read()))
  with open(os.path.join(ROOT, "docs", "metrics.md"), encoding="utf-8") as f:
    glossary = f.read()
  missing = sorted(k for k in keys if f"`{k}" not in glossary)  # a prefix the code filters by counts
  assert len(keys) > 60 and not missing, f"metrics missing from docs/metrics.md: {missing}"


def _smoke_commands():
  """(page, command) for every command of docs/*.md at smoke size (`:tiny` / `:smoke`), continuation lines joined."""
  out = []
  for page in sorted(os.listdir(os.path.join(ROOT, "docs"))):
    if not page.endswith(".md"):
      continue
    text = open(os.path.join(ROOT, "docs", page), encoding="utf-8").read().replace("\\\n", " ")
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
      for line in block.splitlines():
        command, _, comment = line.partition("  #")
        if re.search(r"python -m jalign\.(run|fit) .*--config=\S+:(tiny|smoke)", command):
          out.append((page, shlex.split(command), "error:" in comment))
  return out


SMOKE = _smoke_commands()


def test_every_task_page_has_a_smoke_command():
  pages = {page for page, _, _ in SMOKE}
  assert pages >= {"sft.md", "reward-models.md", "dpo.md", "rl.md", "tools.md", "chain.md", "real-models.md",
                   "scale-out.md", "reliability.md", "distill.md"}, pages


# The commands whose run (the same config to its end) another test of the default run makes run in the long tier
# (CI time): command -> that test.
_COVERED = {
    "--config=configs/pipeline.py:tiny": "tests/train/test_pipeline.py",
    "--config=configs/agent.py:tiny": "tests/rl/test_traces.py (long tier too; the episodes: tests/rl/test_agent.py)",
    "--config=configs/grpo.py:tiny": "tests/rl/test_grpo.py::test_tiny_grpo_runs_and_reports (the command line)",
    "--config=configs/ppo.py:tiny": "tests/rl/test_ppo.py::test_tiny_ppo_runs_and_resumes_the_critic_and_kl_"
                                    "coefficient_exactly (the command line)",
    "--config=configs/sft.py:tiny": "tests/train/test_first_hour.py::test_ctrl_c_saves_exits_130_and_the_rerun_"
                                    "equals_an_uninterrupted_run (the command line)",
    "--config=configs/rm.py:tiny": "tests/train/test_preference_tasks.py (the task's run)",
    "--config=configs/dpo.py:tiny": "tests/train/test_preference_tasks.py (the task's run)",
    "--config=configs/distill.py:tiny": "tests/train/test_distill.py (the task's run)",
}


@pytest.mark.parametrize("page,command,fails", [
    pytest.param(p, c, f, marks=pytest.mark.long) if " ".join(c[3:]) in _COVERED else (p, c, f)
    for p, c, f in SMOKE], ids=[f"{p}:{' '.join(c[3:4])}" for p, c, _ in SMOKE])
def test_docs_command_runs(tmp_path, page, command, fails):
  """Each documented command runs as written at smoke size (one CPU device, the run directory in tmp_path); one
  documented as an error ends with `error:` and status 2. Recipes on a real model (MODEL) are run by
  tests/test_recipes.py on SmolLM2 with the same smoke size."""
  if "MODEL" in " ".join(command):
    recipe = re.search(r"recipes/(\w+)\.py", " ".join(command)).group(1)
    assert recipe in open(os.path.join(ROOT, "tests", "test_recipes.py"), encoding="utf-8").read()
    return
  args = [sys.executable] + command[1:]
  if "jalign.run" in command:
    args.append(f"--config.run_dir={tmp_path / 'run'}")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  if fails:
    assert proc.returncode == 2 and "error:" in proc.stderr, proc.stderr[-2000:]
  else:
    assert proc.returncode == 0, (page, proc.stdout[-2000:], proc.stderr[-3000:])
