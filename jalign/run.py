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


TASKS = {"sft": run_sft, "rollout": run_rollout, "grpo": run_grpo, "ppo": run_grpo, "rm": run_rm,
         "dpo": run_dpo}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if logging.get_verbosity() == logging.INFO:  # keep library INFO chatter (orbax) off the console unless -v
    logging.set_verbosity(logging.WARNING)
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/<task>.py is required")
  try:  # the multi-process runtime first: the device count below is the global one
    section = to_dataclass(DistributedSection, _CONFIG.value.get("distributed", {}), "config.distributed")
    distributed.initialize(section)
    cfg = validate(_CONFIG.value, jax.device_count())
  except (ConfigError, ValueError) as e:
    raise SystemExit(f"config error: {e}") from None
  from jalign.train.loop import NonFiniteError
  try:
    final = TASKS[cfg.task](cfg)
  except NonFiniteError as e:
    raise SystemExit(f"stopped: {e}") from None
  shown = ("eval/", "train/loss", "rollout/", "perf/new", "actor/kl", "critic/score", "rewards/")
  summary = "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items()) if k.startswith(shown))
  if distributed.is_main():
    print(f"done: {summary}", flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  app.run(main)
