"""report.md and PNG plots for a finished run or pipeline, rebuilt from its metrics files at any time:

    python -m jalign.eval.report runs/pipeline        # or any single run directory (one with metrics.jsonl)

A pipeline directory holds 0_base/ and one <i>_<task>/ per stage (each with metrics.jsonl and stage.json); a single
run directory is reported as one stage. The report has a per-stage table of the held-out evaluation, one figure per
stage of its training curves (loss, reward, KL, entropy, accuracy, response length, as logged), and flags stages
that look over-optimised: the reward model's score rose while held-out accuracy or the win rate fell, or the KL to
the reference passed the stage's `kl.max`.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys

from jalign.core import files

# metric name in metrics.jsonl -> label; the first present of each group is plotted
CURVES = (
    ("loss", ("train/loss", "actor/loss")),
    ("reward", ("critic/score/mean", "rewards/margins", "rewards/chosen")),
    ("reward model score", ("critic/rm_score/mean",)),
    ("KL to reference", ("actor/kl_loss", "kl")),
    ("entropy", ("actor/entropy",)),
    ("held-out accuracy", ("eval/accuracy", "eval/pairwise_accuracy")),
    ("response length", ("response_length/mean",)),
)
# evaluation columns of the stage table: key in stage.json's "eval" -> header
COLUMNS = (("eval/accuracy", "accuracy"), ("eval/pass@1", "pass@1"), ("eval/win_rate", "win rate vs base"),
           ("eval/kl_to_reference", "KL to base"), ("eval/rm_score", "RM score"),
           ("eval/response_length", "length"), ("eval/perplexity", "perplexity"),
           ("rm/pairwise_accuracy", "RM pairwise acc."), ("rm/spearman", "RM Spearman"))


def read_metrics(path: str) -> list[dict]:
  """Rows of a metrics.jsonl (a truncated last line, from a run killed mid-write, is ignored)."""
  rows = []
  if not os.path.exists(path):
    return rows
  for line in open(path, encoding="utf-8"):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return rows


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
  points = {}
  for r in rows:
    if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key]):
      points[int(r["step"])] = float(r[key])  # a resumed run may log a step twice: the last value wins
  steps = sorted(points)
  return steps, [points[s] for s in steps]


def stages_of(run_dir: str) -> list[tuple[str, str]]:
  """[(name, directory)] of a pipeline's stages in order, or [(basename, run_dir)] for a single run."""
  names = sorted((d for d in os.listdir(run_dir) if re.fullmatch(r"\d+_\w+", d)
                  and os.path.isdir(os.path.join(run_dir, d))), key=lambda d: int(d.split("_")[0]))
  if names:
    return [(n, os.path.join(run_dir, n)) for n in names]
  return [(os.path.basename(os.path.normpath(run_dir)), run_dir)]


def _stage_info(directory: str) -> dict:
  path = os.path.join(directory, "stage.json")
  if os.path.exists(path):
    return json.load(open(path, encoding="utf-8"))
  evaluation = os.path.join(directory, "eval.json")
  return {"eval": json.load(open(evaluation, encoding="utf-8"))} if os.path.exists(evaluation) else {}


def held_out(rows: list[dict]) -> dict:
  """The newest logged value of every held-out figure (`eval/*`) in a run's metrics rows."""
  out = {}
  for r in sorted(rows, key=lambda r: r.get("step", 0)):
    out.update({k: v for k, v in r.items() if k.startswith("eval/") and isinstance(v, (int, float))})
  return out


def columns(evaluations: list[dict]) -> list[tuple[str, str]]:
  """(key, header) of the table: the named columns any stage has, then any other held-out figure, by name."""
  present = set().union(*evaluations) if evaluations else set()
  named = [(k, h) for k, h in COLUMNS if k in present]
  return named + [(k, k) for k in sorted(present - {k for k, _ in COLUMNS})]


def _ends(values: list[float]) -> tuple[float, float]:
  """Means of the first and the last fifth of a curve (single steps are noisy)."""
  k = max(1, len(values) // 5)
  return sum(values[:k]) / k, sum(values[-k:]) / k


def _trend(values: list[float]) -> float:
  """Mean of the last fifth minus mean of the first fifth (0 for fewer than 2 points)."""
  if len(values) < 2:
    return 0.0
  first, last = _ends(values)
  return last - first


def flags(name: str, rows: list[dict], info: dict, previous_eval: dict, max_kl: float | None) -> list[str]:
  """Over-optimisation warnings for one stage."""
  out = []
  _, rm = series(rows, "critic/rm_score/mean")
  rm_rose = _trend(rm) > 0
  evaluation = info.get("eval", {})
  acc, before = evaluation.get("eval/accuracy"), previous_eval.get("eval/accuracy")
  _, acc_curve = series(rows, "eval/accuracy")
  if rm_rose:
    if acc is not None and before is not None and acc < before:
      first, last = _ends(rm)
      out.append(f"{name}: the reward model's score rose ({first:.3f} -> {last:.3f}, first and last fifth of the "
                 f"run) while held-out accuracy fell ({before:.3f} -> {acc:.3f})")
    elif _trend(acc_curve) < 0:
      out.append(f"{name}: the reward model's score rose while the held-out accuracy curve fell "
                 f"({acc_curve[0]:.3f} -> {acc_curve[-1]:.3f})")
    if evaluation.get("eval/win_rate") is not None and evaluation["eval/win_rate"] < 0.5:
      out.append(f"{name}: the reward model's score rose but the win rate against the base is "
                 f"{evaluation['eval/win_rate']:.3f} < 0.5")
  _, kl = series(rows, "actor/kl_loss")
  if max_kl and kl and max(kl) > max_kl:
    out.append(f"{name}: KL to the reference reached {max(kl):.4f}, above kl.max={max_kl}")
  return out


def plot_stage(name: str, rows: list[dict], out_png: str) -> list[str]:
  """One PNG with a panel per logged curve; returns the curves drawn (none: no file)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = []
  for label, keys in CURVES:
    for key in keys:
      steps, values = series(rows, key)
      if steps:
        panels.append((label, key, steps, values))
        break
  if not panels:
    return []
  cols = min(3, len(panels))
  nrows = math.ceil(len(panels) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.0 * nrows), squeeze=False)
  for ax, (label, key, steps, values) in zip(axes.flat, panels):
    ax.plot(steps, values, marker="o" if len(steps) < 20 else None, markersize=3)
    ax.set_title(f"{label} ({key})", fontsize=9)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  fig.suptitle(name)
  fig.tight_layout()
  os.makedirs(os.path.dirname(out_png), exist_ok=True)
  with files.atomic_path(out_png, suffix=".tmp.png") as tmp:
    fig.savefig(tmp, dpi=90)
  plt.close(fig)
  return [key for _, key, _, _ in panels]


def _cell(value) -> str:
  return "" if value is None else f"{value:.4f}"


def build(run_dir: str) -> str:
  """Writes run_dir/report.md and run_dir/plots/<stage>.png; returns the report's path."""
  pipeline = {}
  if os.path.exists(os.path.join(run_dir, "pipeline.json")):
    pipeline = json.load(open(os.path.join(run_dir, "pipeline.json"), encoding="utf-8"))
  stages = stages_of(run_dir)
  lines = [f"# Report: {os.path.abspath(run_dir)}", ""]
  if pipeline:
    lines += [f"Pipeline {' -> '.join(pipeline.get('order', []))} from `{pipeline.get('base_model', '')}`.", ""]
  infos = [_stage_info(directory) for _, directory in stages]
  metrics = [read_metrics(os.path.join(directory, "metrics.jsonl")) for _, directory in stages]
  # a stage's own evaluation (stage.json / eval.json) over the held-out figures its training logged
  evaluations = [{**held_out(rows), **info.get("eval", {})} for info, rows in zip(infos, metrics)]
  table = columns(evaluations)
  header = ["stage"] + [h for _, h in table]
  lines += ["## Held-out evaluation", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  warnings, figures, previous = [], [], {}
  for (name, directory), info, rows, evaluation in zip(stages, infos, metrics, evaluations):
    lines.append("| " + " | ".join([name] + [_cell(evaluation.get(k)) for k, _ in table]) + " |")
    if rows:
      png = os.path.join(run_dir, "plots", f"{name}.png")
      if plot_stage(name, rows, png):
        figures.append((name, os.path.relpath(png, run_dir)))
    warnings += flags(name, rows, info, previous, pipeline.get("max_kl", {}).get(name))
    if info.get("task") != "rm" and evaluation:
      previous = evaluation
  lines += ["", "Each stage's final held-out figures (its evaluation, else the last logged). Win rate and KL are "
            "against the base model (ties count half); accuracy is greedy on held-out prompts, pass@k from samples.",
            "", "## Over-optimisation checks", ""]
  lines += [f"- WARNING {w}" for w in warnings] or ["- none: no stage raised its reward-model score while held-out "
                                                   "accuracy or win rate fell, and no KL bound was passed"]
  lines += ["", "## Training curves", ""]
  for name, rel in figures:
    lines += [f"### {name}", "", f"![{name}]({rel})", ""]
  path = os.path.join(run_dir, "report.md")
  files.write_text(path, "\n".join(lines) + "\n")
  return path


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1 or argv[0] in ("-h", "--help"):
    print("usage: python -m jalign.eval.report RUN_DIR", file=sys.stderr)
    return 2
  if not os.path.isdir(argv[0]):
    print(f"{argv[0]}: not a directory", file=sys.stderr)
    return 2
  print(build(argv[0]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
