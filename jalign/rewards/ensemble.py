"""Reward-model ensembles on disk: a directory holding one HF sequence-classification checkpoint per member (`0/`,
`1/`, ...) and `reward_ensemble.json` with each member's weight; its score is the weighted sum of theirs (several
reward models combined into one reward, as Llama 2's separate helpfulness and safety models, Touvron et al. 2023,
sec. 3.2.2). `load_scorers` reads either an ensemble or one checkpoint."""
from __future__ import annotations

import json
import math
import os
import shutil

from jalign.core.errors import CheckpointError
from jalign.models.hf import load_sequence_classifier
from jalign.models.reward_model import RewardModel

ENSEMBLE_FILE = "reward_ensemble.json"


def is_ensemble(path: str) -> bool:
  return os.path.isfile(os.path.join(path, ENSEMBLE_FILE))


def ensemble_members(path: str) -> list[tuple[str, float]]:
  """[(member checkpoint directory, weight)] of the ensemble at `path`; malformed files get an error naming them."""
  file = os.path.join(path, ENSEMBLE_FILE)
  try:
    members = json.load(open(file, encoding="utf-8"))["members"]
    out = [(os.path.join(path, str(m["path"])), float(m["weight"])) for m in members]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f'{file}: expected {{"members": [{{"path": DIR, "weight": NUMBER}}, ...]}} ({e!r})') from None
  if not out or not all(math.isfinite(w) for _, w in out):
    raise CheckpointError(f"{file}: needs at least one member, each with a finite weight")
  for d, _ in out:
    if not os.path.isfile(os.path.join(d, "config.json")):
      raise CheckpointError(f"{file}: member {d!r} is not an HF checkpoint directory (no config.json)")
  return out


def write_ensemble(out_dir: str, members: list[tuple[str, float]]) -> None:
  """Copies each member's exported checkpoint into `out_dir`/<i> beside `reward_ensemble.json`. Built under a
  temporary name and renamed, so an interrupted write leaves the previous ensemble (or none), never half of one."""
  tmp = out_dir.rstrip("/") + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  for i, (src, _) in enumerate(members):
    shutil.copytree(src, os.path.join(tmp, str(i)))
  with open(os.path.join(tmp, ENSEMBLE_FILE), "w", encoding="utf-8") as f:
    json.dump({"members": [{"path": str(i), "weight": w} for i, (_, w) in enumerate(members)]}, f, indent=1)
  if os.path.exists(out_dir):
    shutil.rmtree(out_dir)
  os.replace(tmp, out_dir)


def load_scorers(path: str, **kwargs) -> list[tuple[RewardModel, float]]:
  """[(reward model, weight)]: the members of an ensemble directory, or one HF `*ForSequenceClassification`
  checkpoint with weight 1. `kwargs` go to `models.load_sequence_classifier`."""
  paths = ensemble_members(path) if is_ensemble(path) else [(path, 1.0)]
  out = []
  for p, w in paths:
    backbone, score = load_sequence_classifier(p, **kwargs)
    out.append((RewardModel.from_classifier(backbone, score), w))
  return out
