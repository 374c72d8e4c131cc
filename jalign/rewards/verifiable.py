"""Reward functions on decoded text (verifiable, rule-based); a reward model scores in-graph with
`jalign.models.reward_model.RewardModel.score`.

A reward function maps a batch of completions (with their ground truths and token lengths) to float32 scores.
Functions are registered by name so configs pick them (`{"gsm8k": 1.0, "format": 0.1}`). Model output is only ever
parsed with regular expressions and `fractions.Fraction`; nothing is evaluated.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

import numpy as np

from jalign.core.errors import ConfigError, UserError
from jalign.core.sections import bounded
from jalign.data.answers import (
  NUMBER,
  answers_match,
  extract_boxed,
  extract_gsm8k,
  extract_last_number,
)


class RewardError(UserError):
  """Unknown reward name, bad weights, or a record without the ground truth its reward needs."""


@dataclasses.dataclass(frozen=True)
class Batch:
  completions: Sequence[str]
  ground_truths: Sequence[str | None]
  lengths: np.ndarray                      # generated tokens per completion
  where: Sequence[str] = ()                # record locations, for error messages


RewardFn = Callable[[Batch], np.ndarray]
REGISTRY: dict[str, RewardFn] = {}
NEEDS_GROUND_TRUTH: set[str] = set()


def register(name: str, *, verifiable: bool = False):
  def wrap(fn: RewardFn) -> RewardFn:
    REGISTRY[name] = fn
    if verifiable:
      NEEDS_GROUND_TRUTH.add(name)
    return fn
  return wrap


def _check_truth(batch: Batch, name: str) -> None:
  for i, truth in enumerate(batch.ground_truths):
    if truth is None or (isinstance(truth, str) and not truth.strip()):
      where = batch.where[i] if i < len(batch.where) else f"completion {i}"
      raise RewardError(f"{where}: reward {name!r} needs a ground truth ('answer', 'ground_truth' or verl's "
                        "'reward_model.ground_truth'), and this record has none")


def _answer_reward(name: str, extract: Callable[[str], str | None], *, reduce_truth: bool) -> RewardFn:
  """`reduce_truth`: a ground truth that is itself a worked solution (GSM8K's `answer` field, MATH's `solution`) is
  reduced with the same extractor, so datasets read as-is score their gold solutions 1."""
  def fn(batch: Batch) -> np.ndarray:
    _check_truth(batch, name)
    truths = [str(t) for t in batch.ground_truths]
    if reduce_truth:
      truths = [extract(t) or t for t in truths]
    return np.array([float(answers_match(extract(c), t)) for c, t in zip(batch.completions, truths)], np.float32)
  return fn


register("gsm8k", verifiable=True)(_answer_reward("gsm8k", extract_gsm8k, reduce_truth=True))
register("boxed", verifiable=True)(_answer_reward("boxed", extract_boxed, reduce_truth=True))
# a number-less truth such as "x+1" must not reduce to its last number
register("last_number", verifiable=True)(_answer_reward("last_number", extract_last_number, reduce_truth=False))


@register("exact_match", verifiable=True)
def exact_match(batch: Batch) -> np.ndarray:
  """1 when the whole completion, whitespace-trimmed, equals the ground truth."""
  _check_truth(batch, "exact_match")
  return np.array([float(c.strip() == str(t).strip()) for c, t in zip(batch.completions, batch.ground_truths)],
                  np.float32)


FORMAT_PATTERN = re.compile(r"^\s*####\s*" + "(?:" + NUMBER + r")\s*$")


@register("format")
def format_reward(batch: Batch) -> np.ndarray:
  """1 when the completion is exactly an answer line '#### <number>' (the built-in task's format), else 0."""
  return np.array([float(bool(FORMAT_PATTERN.match(c))) for c in batch.completions], np.float32)


def overlong_penalty(lengths: np.ndarray, *, max_length: int, buffer: int) -> np.ndarray:
  """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_length - buffer, then falling linearly
  to -1 at max_length, and -1 beyond."""
  lengths = np.asarray(lengths, np.float64)
  start = max_length - buffer
  return np.where(lengths <= start, 0.0, np.where(lengths <= max_length, (start - lengths) / buffer, -1.0)).astype(
      np.float32)


def length_penalty(lengths: np.ndarray, *, target: int) -> np.ndarray:
  """-(tokens beyond target) / target: a linear cost on verbosity."""
  return (-np.maximum(np.asarray(lengths, np.float64) - target, 0) / target).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class RewardSpec:
  """Weighted sum of registered rewards, plus optional length terms."""
  weights: tuple[tuple[str, float], ...]
  overlong_max_length: int = 0             # 0 = off
  overlong_buffer: int = 0
  length_target: int = 0                   # 0 = off
  length_weight: float = 0.0

  def __post_init__(self):
    for name, _ in self.weights:
      if name not in REGISTRY:
        raise RewardError(f"unknown reward {name!r}; available: {', '.join(sorted(REGISTRY))}")
    if self.overlong_max_length and not 0 < self.overlong_buffer <= self.overlong_max_length:
      raise RewardError(f"overlong_buffer={self.overlong_buffer} must be in (0, overlong_max_length="
                        f"{self.overlong_max_length}]")

  @property
  def needs_ground_truth(self) -> bool:
    return any(name in NEEDS_GROUND_TRUTH for name, _ in self.weights)

  def __call__(self, batch: Batch) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(total reward [N], per-term scores)."""
    terms = {name: REGISTRY[name](batch) for name, _ in self.weights}
    total = sum((w * terms[name] for name, w in self.weights), np.zeros(len(batch.completions), np.float32))
    if self.overlong_max_length:
      terms["overlong"] = overlong_penalty(batch.lengths, max_length=self.overlong_max_length,
                                           buffer=self.overlong_buffer)
      total = total + terms["overlong"]
    if self.length_target:
      terms["length"] = length_penalty(batch.lengths, target=self.length_target)
      total = total + self.length_weight * terms["length"]
    return np.asarray(total, np.float32), terms


@dataclasses.dataclass(frozen=True)
class RewardSection:
  """The reward of RL runs (the run config's `reward` section): verifiable rewards and / or a reward model."""
  weights: tuple = (("gsm8k", 1.0),)      # (name, weight) pairs from REGISTRY
  model: str = ""                         # a reward model: an HF *ForSequenceClassification dir, or an ensemble dir
                                          # (configs/rm.py's run_dir/ensemble)
  model_weight: float = bounded(1.0)      # its score's weight in the reward
  overlong_max_length: int = bounded(0, ge=0)  # DAPO overlong penalty; 0 = off
  # DAPO overlong penalty: the last N tokens before max_new_tokens cost up to overlong_penalty
  overlong_buffer: int = bounded(0, ge=0)
  length_target: int = bounded(0, ge=0)   # linear length penalty; 0 = off
  length_weight: float = bounded(0.0)     # reward per response token (negative: shorter answers); 0 = off

  def spec(self) -> RewardSpec:
    return RewardSpec(weights=tuple((str(n), float(x)) for n, x in self.weights),
                      overlong_max_length=self.overlong_max_length, overlong_buffer=self.overlong_buffer,
                      length_target=self.length_target, length_weight=self.length_weight)

  def check(self) -> None:
    """A reward is configured, its names exist, and a reward model is one (or an ensemble of them)."""
    if not self.weights and not self.model:
      raise ConfigError("config.reward: no reward configured; set reward.weights (verifiable rewards) and/or "
                        "reward.model (a reward model checkpoint)")
    if self.model:
      from jalign.models.hf import architectures
      from jalign.rewards.ensemble import ensemble_members, is_ensemble
      try:  # one checkpoint, or each member of an ensemble directory
        paths = [p for p, _ in ensemble_members(self.model)] if is_ensemble(self.model) else [self.model]
      except ValueError as e:
        raise ConfigError(f"config.reward.model={self.model!r}: {e}") from None
      for path in paths:
        try:
          archs = architectures(path)
        except (OSError, ValueError) as e:
          raise ConfigError(f"config.reward.model={path!r}: cannot read its config.json ({e})") from None
        if not any(a.endswith("ForSequenceClassification") for a in archs):
          raise ConfigError(f"config.reward.model={path!r}: architectures {archs} is not a "
                            "*ForSequenceClassification reward model (nor a reward-model ensemble directory with "
                            "reward_ensemble.json)")
    try:
      self.spec()
    except RewardError as e:
      raise ConfigError(f"config.reward: {e}") from None
