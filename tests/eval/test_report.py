"""report.md and plots from metrics files: the table holds exactly the stages' evaluation numbers, the plots are real
PNG images of the logged curves, and the over-optimisation checks fire when the reward model's score rises while
held-out accuracy falls or when the KL passes its bound (and stay quiet otherwise)."""
import json
import subprocess
import sys

import numpy as np
from PIL import Image

from jalign.eval import report
from tests.configs_util import ROOT


def _stage(root, name, task, evaluation, rows):
  d = root / name
  d.mkdir(parents=True)
  (d / "stage.json").write_text(json.dumps({"task": task, "eval": evaluation}))
  with open(d / "metrics.jsonl", "w") as f:
    for r in rows:
      f.write(json.dumps(r) + "\n")
    f.write('{"step": 99, "train/lo')  # a line cut off by a kill mid-write is ignored


def _pipeline(root, rm_curve, accuracy_after, kl_curve, max_kl=0.5):
  (root).mkdir(parents=True, exist_ok=True)
  (root / "pipeline.json").write_text(json.dumps({"base_model": "base", "order": ["sft", "grpo"],
                                                  "max_kl": {"2_grpo": max_kl}}))
  _stage(root, "0_base", "base", {"eval/accuracy": 0.664, "eval/response_length": 5.1}, [])
  _stage(root, "1_sft", "sft", {"eval/accuracy": 0.68, "eval/win_rate": 0.55, "eval/kl_to_reference": 0.0123},
         [{"step": s, "train/loss": 1.0 / s} for s in range(1, 11)])
  _stage(root, "2_grpo", "grpo", {"eval/accuracy": accuracy_after, "eval/win_rate": 0.6, "eval/rm_score": 0.81},
         [{"step": s + 1, "actor/loss": 0.1, "critic/score/mean": 0.5 + 0.01 * s, "critic/rm_score/mean": r,
           "actor/kl_loss": k, "actor/entropy": 0.3, "response_length/mean": 5.0}
          for s, (r, k) in enumerate(zip(rm_curve, kl_curve))] + [{"step": 10, "eval/accuracy": accuracy_after}])


def test_table_plots_and_quiet_checks(tmp_path):
  root = tmp_path / "run"
  _pipeline(root, rm_curve=np.linspace(0.5, 0.4, 10), accuracy_after=0.70, kl_curve=np.linspace(0, 0.1, 10))
  text = open(report.build(str(root))).read()
  cells = lambda line: [c.strip() for c in line.strip()[1:-1].split("|")]  # noqa: E731
  table = [cells(line) for line in text.splitlines() if line.startswith("| ") and "---" not in line]
  header, rows = table[0], {row[0]: row for row in table[1:]}
  evaluations = {name: json.load(open(root / name / "stage.json"))["eval"] for name in ("0_base", "1_sft", "2_grpo")}
  for key, column in report.COLUMNS:  # a named column where any stage has its figure, none where no stage has
    if not any(key in e for e in evaluations.values()):
      assert column not in header, column
      continue
    for name, evaluation in evaluations.items():
      cell = rows[name][header.index(column)]
      assert cell == (f"{evaluation[key]:.4f}" if key in evaluation else ""), (name, key)
  for name in ("1_sft", "2_grpo"):
    png = root / "plots" / f"{name}.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as im:
      im.verify()
    assert f"plots/{name}.png" in text
  assert not (root / "plots" / "0_base.png").exists()  # nothing logged, no figure
  assert "- none:" in text


def test_over_optimisation_and_kl_bound_are_flagged(tmp_path):
  root = tmp_path / "run"
  _pipeline(root, rm_curve=np.linspace(0.4, 0.9, 10), accuracy_after=0.60, kl_curve=np.linspace(0, 0.8, 10))
  proc = subprocess.run([sys.executable, "-m", "jalign.eval.report", str(root)], cwd=ROOT, capture_output=True,
                        text=True)
  assert proc.returncode == 0, proc.stderr
  text = open(root / "report.md").read()
  # rm curve 0.4 .. 0.9 in 10 steps: first fifth (0.400, 0.456), last fifth (0.844, 0.900)
  assert "WARNING 2_grpo: the reward model's score rose (0.428 -> 0.872, first and last fifth of the run) while " \
         "held-out accuracy fell (0.680 -> 0.600)" in text
  assert "WARNING 2_grpo: KL to the reference reached 0.8000, above kl.max=0.5" in text


def test_single_run_directory(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for s in range(1, 6):
      f.write(json.dumps({"step": s, "train/loss": 2.0 - 0.1 * s}) + "\n")
    # held-out figures as a training run logs them: at eval_every and at the end (the newest counts)
    f.write(json.dumps({"step": 3, "eval/accuracy": 0.7, "eval/pairwise_accuracy": 0.5, "eval/spearman": 0.1}) + "\n")
    f.write(json.dumps({"step": 5, "eval/accuracy": 0.812, "eval/pairwise_accuracy": 0.565, "eval/spearman": 0.42,
                        "eval/loss": 0.69}) + "\n")
  text = open(report.build(str(tmp_path))).read()
  assert (tmp_path / "plots" / f"{tmp_path.name}.png").exists() and "Training curves" in text
  table = [line for line in text.splitlines() if line.startswith("| ")]
  assert table[0] == "| stage | accuracy | eval/loss | eval/pairwise_accuracy | eval/spearman |"
  assert table[2] == f"| {tmp_path.name} | 0.8120 | 0.6900 | 0.5650 | 0.4200 |"
