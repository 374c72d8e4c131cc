"""The tasks a config's `task` key names, one module each, and the one registry `run.py`, the chain and the fit check
read: sft, rm (reward models), dpo (the DPO family and KTO), grpo and ppo (online, offline and asynchronous RL),
distill (a teacher into the student: offline, GKD, on-policy), rollout (sampling into a replay buffer) and eval; `chain` runs several of them in a row.

A training task is a `jalign.train.task.Task`: the shared loop runs it, and its module's `task(cfg)` builds it."""
from __future__ import annotations

import importlib

MODULES = {"sft": "sft", "rm": "rm", "dpo": "dpo", "grpo": "grpo", "ppo": "grpo", "rollout": "rollout",
           "distill": "distill", "eval": "eval"}
TRAINING = ("sft", "rm", "grpo", "ppo", "dpo", "distill")  # the tasks that train and export a model (a chain's stages)


def module(task: str):
  """The module of `task` (imported on first use: a task's dependencies load only when it runs)."""
  if task not in MODULES:
    raise ValueError(f"task {task!r}; available: {', '.join(MODULES)}")
  return importlib.import_module(f"{__name__}.{MODULES[task]}")


def run(cfg) -> dict:
  """Runs `cfg.task` to the end; its final metrics."""
  return module(cfg.task).run(cfg)


def task(cfg):
  """The `Task` of a training config, as its run builds it."""
  if cfg.task not in TRAINING:
    raise ValueError(f"task {cfg.task!r} does not train; training tasks: {', '.join(TRAINING)}")
  return module(cfg.task).task(cfg)
