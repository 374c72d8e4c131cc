"""The chain of stages (`configs/pipeline.py`): SFT -> reward model -> GRPO / PPO -> DPO, each stage a full run of
its task starting from the previous stage's exported checkpoint.

Each stage runs in run_dir/<i>_<task> and resumes there like any run; a finished stage leaves `stage.json` (its
final metrics and held-out evaluation) and is skipped when the pipeline is rerun, so a pipeline killed in its third
stage continues inside that stage. The base model is evaluated once first (run_dir/0_base); every policy stage is
evaluated against it (win rate, KL) and scored by the pipeline's reward model once there is one. At the end
run_dir/report.md and run_dir/plots/ are (re)built from the metrics files.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

from jalign import tasks
from jalign.config import validate
from jalign.core import files
from jalign.core.errors import ConfigError
from jalign.core.sections import to_dataclass
from jalign.eval import policy as policy_eval
from jalign.eval import report
from jalign.eval.policy import EvalSection
from jalign.parallel.distributed import is_main, say
from jalign.rewards.ensemble import is_ensemble
from jalign.tasks import rm

KEYS = ("task", "run_dir", "base_model", "order", "rm_weight", "stages", "eval", "distributed")


def _write_json(path: str, obj) -> None:
  if not is_main():
    return
  os.makedirs(os.path.dirname(path), exist_ok=True)
  files.write_json(path, obj, indent=1)


def stage_configs(values, num_devices: int) -> list[tuple[str, str, Any]]:
  """[(stage name, task, validated RunConfig)] with the chain wired in; every config error names its stage key."""
  c = values.to_dict() if hasattr(values, "to_dict") else copy.deepcopy(values)
  unknown = sorted(set(c) - set(KEYS))
  if unknown:
    raise ConfigError(f"config.{unknown[0]}: unknown key; accepted keys of a pipeline config: {', '.join(KEYS)}")
  order = tuple(c["order"])
  bad = [t for t in order if t not in tasks.TRAINING]
  if bad or not order:
    raise ConfigError(f"config.order={order}: stages must be among {', '.join(tasks.TRAINING)}")
  if order.count("rm") > 1:
    raise ConfigError(f"config.order={order}: at most one reward-model stage")
  policy, rm_path, out = c["base_model"], "", []
  for i, task in enumerate(order, 1):
    name = f"{i}_{task}"
    if task not in c["stages"]:
      raise ConfigError(f"config.stages.{task}: missing; the stages given are {', '.join(c['stages'])}")
    stage = copy.deepcopy(c["stages"][task])
    stage["run_dir"] = os.path.join(c["run_dir"], name)
    stage["model"]["path"] = policy
    if stage["model"].get("arch") is not None:
      stage["model"]["arch"] = None
    stage["tokenizer"] = ""  # each exported checkpoint carries its tokenizer
    # The reward model joins the RL reward once its stage has exported it (the pipeline re-wires each stage just
    # before running it; a check before the first stage sees the verifiable reward alone).
    exported_rm = rm_path and (os.path.exists(os.path.join(rm_path, "config.json")) or is_ensemble(rm_path))
    if task in ("grpo", "ppo") and exported_rm and c["rm_weight"]:
      stage["reward"]["model"], stage["reward"]["model_weight"] = rm_path, float(c["rm_weight"])
    stage.setdefault("distributed", c.get("distributed", {}))
    try:
      cfg = validate(stage, num_devices)
    except ConfigError as e:
      raise ConfigError(str(e).replace("config.", f"config.stages.{task}.", 1)) from None
    out.append((name, task, cfg))
    if task == "rm":  # its model, or its ensemble (rm.members)
      rm_path = rm.reward_model_dir(cfg)
    else:
      policy = os.path.join(stage["run_dir"], "hf")
  return out


def run(values, num_devices: int) -> dict:
  stages = stage_configs(values, num_devices)
  c = values.to_dict() if hasattr(values, "to_dict") else values
  e = to_dataclass(EvalSection, c["eval"], "config.eval")
  root, base = c["run_dir"], c["base_model"]
  _write_json(os.path.join(root, "pipeline.json"),
              {"base_model": base, "order": list(c["order"]), "stages": [n for n, _, _ in stages],
               "max_kl": {n: cfg.kl.max for n, t, cfg in stages if t in ("grpo", "ppo")}})
  marker = os.path.join(root, "0_base", "stage.json")
  if not os.path.exists(marker):
    say(f"evaluating the base model {base}")
    _write_json(marker, {"task": "base", "eval": policy_eval.evaluate(e, base)})
  rm_path, results = "", {}
  for index in range(len(stages)):
    name, task, cfg = stage_configs(values, num_devices)[index]  # wired to what earlier stages exported
    marker = os.path.join(cfg.run_dir, "stage.json")
    if os.path.exists(marker):
      say(f"stage {name}: finished earlier ({marker}); not rerun")
      info = json.load(open(marker, encoding="utf-8"))
    else:
      say(f"stage {name}: {task} from {cfg.model.path} -> {cfg.run_dir}")
      final = tasks.run(cfg)
      exported = os.path.join(cfg.run_dir, "hf")
      if task == "rm":
        evaluation = policy_eval.pair_metrics(rm.reward_model_dir(cfg), _tokenizer(exported),
                                              cfg.data.eval or cfg.data.train, max_length=cfg.data.max_length,
                                              batch_size=e.batch_size) if (cfg.data.eval or cfg.data.train) else {}
      else:
        evaluation = policy_eval.evaluate(dataclasses.replace(e, reference=base, reward_model=rm_path), exported)
      info = {"task": task, "model": cfg.model.path, "final": final, "eval": evaluation}
      _write_json(marker, info)
    if task == "rm":
      rm_path = rm.reward_model_dir(cfg)
    results[name] = info
  path = report.build(root) if is_main() else None
  if path:
    say(f"report: {path}")
  last = [n for n, t, _ in stages if t != "rm"]
  return {k: v for k, v in results[last[-1]]["eval"].items()} if last else {}


def _tokenizer(path: str):
  from jalign.tokenizers import tokenizer
  return tokenizer.load(path)
