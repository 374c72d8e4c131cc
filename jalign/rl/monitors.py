"""Safety monitors for policy optimisation: signals a user should see before trusting a run.

- entropy collapse: the policy's mean token entropy fell below a floor (it has stopped exploring; GRPO groups then
  share one answer and carry no signal);
- reward hacking: between two held-out evaluations the training reward rose while held-out verifiable accuracy fell
  by more than two standard errors of the estimate (the policy is learning the reward, not the task);
- critic failure: the critic explains none of the returns' variance (explained variance <= 0) for a whole window.
Each raises a `monitor/*` metric (1 on the step it fires) and a warning line; none stops the run (`grpo.max_kl` does).
"""
from __future__ import annotations

import numpy as np


class Monitors:
  def __init__(self, *, entropy_floor: float, window: int = 10):
    self.entropy_floor, self.window = entropy_floor, window
    self._rewards: list[float] = []   # training reward since the last evaluation
    self._explained: list[float] = []
    self._last_eval: tuple[float, float] | None = None  # (mean training reward before it, accuracy)
    self._entropy_warned = False

  def after_step(self, step: int, metrics: dict) -> tuple[dict, list[str]]:
    out, warnings = {}, []
    self._rewards.append(metrics.get("critic/score/mean", np.nan))
    entropy = metrics.get("actor/entropy")
    if self.entropy_floor and entropy is not None and entropy < self.entropy_floor:
      out["monitor/entropy_collapse"] = 1.0
      if not self._entropy_warned:
        warnings.append(f"step {step}: policy entropy {entropy:.4f} is below grpo.entropy_floor="
                        f"{self.entropy_floor} (entropy collapse: samples stop differing; consider a higher "
                        "temperature, entropy_coef or clip_high)")
        self._entropy_warned = True
    if "critic/vf_explained_var" in metrics:
      self._explained = (self._explained + [metrics["critic/vf_explained_var"]])[-self.window:]
      if len(self._explained) == self.window and max(self._explained) <= 0:
        out["monitor/critic_failure"] = 1.0
        warnings.append(f"step {step}: the critic's explained variance has been <= 0 for {self.window} steps "
                        f"(last {self._explained[-1]:.3f}); its values are no better than a constant")
        self._explained = []
    return out, warnings

  def after_eval(self, step: int, accuracy: float, examples: int) -> tuple[dict, list[str]]:
    reward = float(np.nanmean(self._rewards)) if self._rewards else float("nan")
    self._rewards = []
    out, warnings = {}, []
    if self._last_eval is not None:
      prev_reward, prev_acc = self._last_eval
      noise = 2.0 * np.sqrt(max(prev_acc * (1.0 - prev_acc), 1e-12) / max(examples, 1))  # two binomial SEs
      if reward > prev_reward and accuracy < prev_acc - noise:
        out["monitor/reward_hacking"] = 1.0
        warnings.append(f"step {step}: training reward rose ({prev_reward:.4f} -> {reward:.4f}) while held-out "
                        f"accuracy fell ({prev_acc:.4f} -> {accuracy:.4f}): possible reward hacking")
    self._last_eval = (reward, accuracy)
    return out, warnings
