"""`python -m jalign.run --config=configs/<task>.py[:tiny] [--config.key=value ...]`

Parses and validates the config, then runs its task. Each task wires an objective's loss to the shared loop.
"""
from __future__ import annotations

import jax
from absl import app, logging
from ml_collections import config_flags

from jalign.config import ConfigError, RunConfig, to_dataclass, validate
from jalign.parallel import distributed
from jalign.parallel.distributed import DistributedSection

_CONFIG = config_flags.DEFINE_config_file("config", None, "Task config: configs/<task>.py[:arg]", lock_config=True)


def run_sft(cfg: RunConfig) -> dict:
  from jalign.train import sft
  return sft.run(cfg)


def run_rollout(cfg: RunConfig) -> dict:
  from jalign.train import rollout
  return rollout.run(cfg)


def run_grpo(cfg: RunConfig) -> dict:
  from jalign.train import grpo
  return grpo.run(cfg)


def run_rm(cfg: RunConfig) -> dict:
  from jalign.train import reward
  return reward.run(cfg)


def run_dpo(cfg: RunConfig) -> dict:
  from jalign.train import dpo
  return dpo.run(cfg)


def run_eval(cfg: RunConfig) -> dict:
  import json
  import os

  from jalign.eval.policy import evaluate
  out = evaluate(cfg.eval, cfg.model.path, tokenizer=cfg.tokenizer, fields=cfg.data.fields())
  if distributed.is_main():
    os.makedirs(cfg.run_dir, exist_ok=True)
    path = os.path.join(cfg.run_dir, "eval.json")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"checkpoint": os.path.abspath(cfg.model.path), **out}, f, indent=1)
    os.replace(path + ".tmp", path)
    for k, v in out.items():
      print(f"{k}: {v:.4f}", flush=True)
  return out


TASKS = {"sft": run_sft, "rollout": run_rollout, "grpo": run_grpo, "ppo": run_grpo, "rm": run_rm,
         "dpo": run_dpo, "eval": run_eval}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if logging.get_verbosity() == logging.INFO:  # keep library INFO chatter (orbax) off the console unless -v
    logging.set_verbosity(logging.WARNING)
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/<task>.py is required")
  from jalign.train.loop import NonFiniteError
  from jalign.train.preemption import EXIT_CODE, Preempted
  is_pipeline = _CONFIG.value.get("task") == "pipeline"
  try:  # the multi-process runtime first: the device count below is the global one
    section = to_dataclass(DistributedSection, _CONFIG.value.get("distributed", {}), "config.distributed")
    distributed.initialize(section)
    if is_pipeline:
      from jalign.train import pipeline
      pipeline.stage_configs(_CONFIG.value, jax.device_count())  # every stage's config checked before any runs
    else:
      cfg = validate(_CONFIG.value, jax.device_count())
  except (ConfigError, ValueError) as e:
    raise SystemExit(f"config error: {e}") from None
  try:
    final = pipeline.run(_CONFIG.value, jax.device_count()) if is_pipeline else TASKS[cfg.task](cfg)
  except NonFiniteError as e:
    raise SystemExit(f"stopped: {e}") from None
  except Preempted as e:  # a distinct status, so supervisors restart it; the same command resumes
    print(f"preempted: {e}; exit status {EXIT_CODE}", flush=True)
    distributed.shutdown()
    raise SystemExit(EXIT_CODE) from None
  if not is_pipeline and cfg.task not in ("eval", "rollout") and distributed.is_main():
    from jalign.eval import report
    print(f"report: {report.build(cfg.run_dir)}", flush=True)
  shown = ("eval/", "train/loss", "rollout/", "perf/new", "actor/kl", "critic/score", "rewards/", "ensemble/")
  summary = "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items()) if k.startswith(shown))
  if distributed.is_main():
    print(f"done: {summary}", flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  app.run(main)
