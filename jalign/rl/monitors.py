"""Safety monitors for policy optimisation: signals a user should see before trusting a run.

- no signal: every advantage of a step was 0 (each group's rewards equal), counted, and warned about once when the
  run's first steps all had none (a reward that scores everything alike: a wrong ground-truth field, a format the
  policy never produces), naming the reward and a scored record;
- entropy collapse: the policy's mean token entropy fell below a floor (it has stopped exploring; GRPO groups then
  share one answer and carry no signal); not judged on a step without signal, whose entropy is not measured;
- reward hacking: between two held-out evaluations the training reward rose while held-out verifiable accuracy fell
  by more than two standard errors of the estimate (the policy is learning the reward, not the task);
- critic failure: the critic explains none of the returns' variance (explained variance <= 0) for a whole window.
Each raises a `monitor/*` metric (1 on the step it fires) and a warning line; none stops the run (`kl.max` does).
"""
from __future__ import annotations

import numpy as np


class Monitors:
  def __init__(self, *, entropy_floor: float, window: int = 10, no_signal_warn_steps: int = 0):
    self.entropy_floor, self.window, self.no_signal_warn_steps = entropy_floor, window, no_signal_warn_steps
    self.no_signal_steps = 0           # steps without signal so far (this process)
    self._signal_seen = False
    self._rewards: list[float] = []   # training reward since the last evaluation
    self._explained: list[float] = []
    self._last_eval: tuple[float, float] | None = None  # (mean training reward before it, accuracy)
    self._entropy_warned = False

  def after_step(self, step: int, metrics: dict, example: str = "") -> tuple[dict, list[str]]:
    """`example`: one scored record of the step (where, ground truth, completion, reward) for the no-signal
    warning."""
    out, warnings = {}, []
    self._rewards.append(metrics.get("critic/score/mean", np.nan))
    no_signal = metrics.get("actor/no_signal", 0.0) > 0
    if no_signal:
      self.no_signal_steps += 1
      out["monitor/no_signal_steps"] = float(self.no_signal_steps)
      if not self._signal_seen and self.no_signal_steps == self.no_signal_warn_steps:
        warnings.append(f"step {step}: none of the first {self.no_signal_steps} steps carried any signal (every "
                        f"group's rewards were equal; mean reward {metrics.get('critic/score/mean', np.nan):.4f}): "
                        f"check the reward and the records' ground truths. {example}")
    else:
      self._signal_seen = True
    entropy = metrics.get("actor/entropy")
    if self.entropy_floor and not no_signal and entropy is not None and entropy < self.entropy_floor:
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
