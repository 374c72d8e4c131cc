"""Rank correlations between model scores and gold scores (ties handled as in the standard definitions)."""
from __future__ import annotations

import numpy as np


def average_ranks(x) -> np.ndarray:
  """1-based ranks; tied values share the mean of the ranks they span."""
  x = np.asarray(x, np.float64)
  order = np.argsort(x, kind="mergesort")
  ranks = np.empty(len(x), np.float64)
  sorted_x = x[order]
  start = 0
  for end in range(1, len(x) + 1):
    if end == len(x) or sorted_x[end] != sorted_x[start]:
      ranks[order[start:end]] = (start + end + 1) / 2.0
      start = end
  return ranks


def spearman(x, y) -> float:
  """Spearman's rho: the Pearson correlation of average ranks. NaN when either side is constant."""
  rx, ry = average_ranks(x), average_ranks(y)
  rx, ry = rx - rx.mean(), ry - ry.mean()
  denom = np.sqrt(np.sum(rx * rx) * np.sum(ry * ry))
  return float(np.sum(rx * ry) / denom) if denom > 0 else float("nan")


def kendall_tau_b(x, y) -> float:
  """Kendall's tau-b (Kendall 1945): (concordant - discordant) / sqrt((n0 - ties_x) (n0 - ties_y)). O(n^2) over
  pairs in blocks, which is fine for held-out sets of a few thousand scores."""
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  n = len(x)
  concordant_minus_discordant = 0.0
  ties_x = ties_y = 0.0
  for i in range(n - 1):
    dx, dy = np.sign(x[i + 1:] - x[i]), np.sign(y[i + 1:] - y[i])
    concordant_minus_discordant += float(np.sum(dx * dy))
    ties_x += float(np.sum(dx == 0))
    ties_y += float(np.sum(dy == 0))
  n0 = n * (n - 1) / 2
  denom = np.sqrt((n0 - ties_x) * (n0 - ties_y))
  return float(concordant_minus_discordant / denom) if denom > 0 else float("nan")


def pair_metrics(scores, examples: list[dict]) -> dict[str, float]:
  """A reward model's scores [N, 2] (chosen, rejected) of N pairs: pairwise accuracy (chosen above rejected) and mean
  margin; Spearman and Kendall tau-b against the gold scores when every pair carries `chosen_score` and
  `rejected_score`."""
  scores = np.asarray(scores, np.float64)
  diff = scores[:, 0] - scores[:, 1]
  out = {"pairwise_accuracy": float(np.mean(diff > 0)), "mean_margin": float(np.mean(diff))}
  if len(examples) and all("chosen_score" in e and "rejected_score" in e for e in examples):
    gold = np.asarray([[e["chosen_score"], e["rejected_score"]] for e in examples], np.float64)
    out["spearman"] = spearman(scores.reshape(-1), gold.reshape(-1))
    out["kendall"] = kendall_tau_b(scores.reshape(-1), gold.reshape(-1))
  return out
