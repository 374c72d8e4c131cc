"""The run configuration: every section, assembled as `RunConfig`, validated from an `ml_collections.ConfigDict`.

Each section is a frozen dataclass declared beside the code that reads it, its bounds on its fields
(`jalign.core.sections`); this module holds the loop's own sections (train, optim, checkpoint, log) and the checks that
span sections: the mesh against the batch and the machine, and each task's needs. Jitted code only ever sees these
dataclasses.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Literal

import ml_collections

from jalign.core import sections
from jalign.core.errors import ConfigError
from jalign.core.sections import bounded
from jalign.data.pipeline import DataSection
from jalign.eval.policy import EvalSection
from jalign.kernels.logprobs import LogprobOptions
from jalign.losses.advantages import AdvantageSection
from jalign.losses.policy import KlSection
from jalign.models.config import ModelSection
from jalign.objectives.distill import DistillSection
from jalign.objectives.dpo import DpoSection
from jalign.objectives.grpo import PolicyLossSection
from jalign.objectives.ppo import CriticSection
from jalign.objectives.reward import RewardModelSection
from jalign.parallel.distributed import DistributedSection, say
from jalign.parallel.shardings import MESH_SHAPE, MeshSection
from jalign.rewards.verifiable import RewardSection
from jalign.rl import config as rl_config
from jalign.rl.agentic.env import EnvSection
from jalign.rl.buffer import RolloutSection
from jalign.rl.config import GrpoSection
from jalign.rl.rollout import SamplingSection


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = bounded(1000, gt=0)        # optimizer steps (GRPO / PPO: steps of prompts_per_step groups)
  batch_size: int = bounded(32, gt=0)     # global rows per optimizer step (packed rows when packing)
  micro_batches: int = bounded(1, gt=0)   # gradient accumulation: a lax.scan over this many slices
  seq_len: int = bounded(512, gt=0)       # tokens per row of a batch (packed or padded)
  log_every: int = bounded(10, gt=0)      # steps between metric rows
  eval_every: int = bounded(0, ge=0)      # 0 = only at the end
  eval_batches: int = bounded(8, ge=0)    # held-out loss: batches of batch_size rows from data.eval
  eval_examples: int = bounded(256, ge=0)  # held-out task check: prompts of the generative accuracy; a reward
                                          # model's pairs (0 = eval_batches x batch_size pairs, both 0 = all)
  nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/Inf loss or gradient: the update is never applied; then stop
                                          # naming the step and its records, or skip on (counted)


@dataclasses.dataclass(frozen=True)
class OptimSection:
  lr: float = bounded(1e-4, gt=0)         # peak learning rate
  # after warmup: cosine or linear decay to lr x min_lr_ratio, or constant
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  warmup_steps: int = bounded(0, ge=0)    # clipped to train.steps (with a warning)
  min_lr_ratio: float = bounded(0.0, ge=0, le=1)  # cosine/linear end value as a fraction of lr
  weight_decay: float = bounded(0.0, ge=0)  # AdamW, not applied to norm scales and biases
  b1: float = bounded(0.9, ge=0, lt=1)    # AdamW first-moment decay
  b2: float = bounded(0.999, ge=0, lt=1)  # AdamW second-moment decay
  eps: float = bounded(1e-8, ge=0)        # AdamW denominator epsilon
  clip_norm: float = bounded(1.0, ge=0)   # global-norm clipping; 0 = off


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = bounded(0, ge=0)           # steps between checkpoints; 0 = only at the end (and on SIGTERM)
  keep: int = bounded(3, gt=0)            # checkpoints kept (the newest)
  resume: bool = True                     # continue from the newest complete checkpoint in run_dir
  export_hf: bool = True                  # write an HF checkpoint to run_dir/hf at the end
  async_save: bool = True                 # write checkpoints in the background while training continues
  preempt_grace_s: float = bounded(30.0, ge=0)  # after SIGTERM: save within this long or exit 143 anyway (spot VMs and
                                          # Kubernetes give 30 s before SIGKILL); 0 = no limit


@dataclasses.dataclass(frozen=True)
class LogSection:
  progress: bool = True                   # console progress bar with ETA
  jsonl: bool = True                      # run_dir/metrics.jsonl
  tensorboard: bool = True                # run_dir/tensorboard (tensorboardX, when installed)
  wandb: bool = False                     # when wandb is installed
  wandb_project: str = "jalign"           # Weights & Biases project (with log.wandb)
  peak_flops: float = bounded(0.0, ge=0)  # per device, for MFU; 0 = from the device kind when known
  samples: int = bounded(2, ge=0)         # sampled completions shown with their rewards (RL, evaluation); 0 = none
  samples_every: int = bounded(50, gt=0)  # steps between them (and the first step): console, samples.jsonl,
                                          # TensorBoard text


@dataclasses.dataclass(frozen=True)
class RunConfig:
  # what the run does (`jalign.tasks`); a chain of them is configs/pipeline.py
  task: Literal["sft", "rollout", "grpo", "ppo", "rm", "dpo", "distill", "eval"] = "sft"
  run_dir: str = "runs/default"           # checkpoints, metrics, exports and the report; a rerun resumes here
  seed: int = 0                           # model initialisation, data order, sampling
  tokenizer: str = ""                  # directory with tokenizer.json; "" = model.path
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  train: TrainSection = TrainSection()
  optim: OptimSection = OptimSection()
  mesh: MeshSection = MeshSection()
  checkpoint: CheckpointSection = CheckpointSection()
  log: LogSection = LogSection()
  logprobs: LogprobOptions = LogprobOptions()
  sampling: SamplingSection = SamplingSection()
  reward: RewardSection = RewardSection()
  rollout: RolloutSection = RolloutSection()
  grpo: GrpoSection = GrpoSection()
  advantage: AdvantageSection = AdvantageSection()
  kl: KlSection = KlSection()
  policy_loss: PolicyLossSection = PolicyLossSection()
  critic: CriticSection = CriticSection()
  env: EnvSection = EnvSection()
  rm: RewardModelSection = RewardModelSection()
  dpo: DpoSection = DpoSection()
  distill: DistillSection = DistillSection()   # a teacher distilled into the model (task 'distill')
  distributed: DistributedSection = DistributedSection()   # multi-process start-up (jalign.parallel.distributed)
  eval: EvalSection = EvalSection()    # held-out evaluation of a checkpoint (jalign.eval.policy)


# The sections each task reads (`jalign.tasks`), and the keys of a section it reads that it leaves to its own section.
# A value other than the default anywhere else is a ConfigError: a setting is never dropped without a word.
_COMMON = ("model", "data", "log", "distributed")
_TRAINING = _COMMON + ("mesh", "train", "optim", "checkpoint")
_RL = ("grpo", "advantage", "kl", "policy_loss", "critic", "env")
READS = {
    "sft": _TRAINING + ("logprobs",),
    "rm": _TRAINING + ("rm",),
    "dpo": _TRAINING + ("logprobs", "dpo", "reward"),   # the reward: the verifier of the held-out win rate
    "grpo": _TRAINING + ("logprobs", "sampling", "reward") + _RL,
    "ppo": _TRAINING + ("logprobs", "sampling", "reward") + _RL,
    "rollout": _COMMON + ("mesh", "sampling", "reward", "rollout"),
    "eval": _COMMON + ("eval",),
    # distillation by mode (`distill.mode`): on_policy is the RL update with the teacher's per-token reverse KL as
    # its reward, so it sets the KL and advantage settings itself
    "distill": _TRAINING + ("logprobs", "distill"),
    "distill:gkd": _TRAINING + ("logprobs", "distill", "sampling"),
    "distill:on_policy": _TRAINING + ("logprobs", "distill", "sampling", "reward", "grpo", "policy_loss", "env"),
}
_RL_TRAIN = {"batch_size": "a step's batch is grpo.prompts_per_step x sampling.num_samples completions",
             "micro_batches": "a step's updates are grpo.mini_batches",
             "eval_batches": "held-out prompts are grpo.eval_prompts", "eval_examples": "see grpo.eval_examples"}
_ROUTER = {k: "MoE router terms train with SFT, RM, DPO, offline / GKD distillation, GRPO and PPO"
           for k in ("router_aux_loss", "router_z_loss")}
_CAPACITY = {"moe_capacity_factor": "RL and sampling route dropless (capacity drops depend on the batch, so the "
                                    "sampler's experts would differ from the trainer's); SFT and DPO read it"}
UNREAD_KEYS = {"grpo": {"train": _RL_TRAIN}, "ppo": {"train": _RL_TRAIN}, "distill:on_policy": {"train": _RL_TRAIN}}
for _task in READS:
  if _task not in ("sft", "rm", "dpo", "distill", "distill:gkd", "grpo", "ppo"):
    UNREAD_KEYS.setdefault(_task, {})["model"] = dict(_ROUTER)
  if _task not in ("sft", "dpo"):
    UNREAD_KEYS.setdefault(_task, {}).setdefault("model", {}).update(_CAPACITY)


def reads_key(cfg) -> str:
  """The `READS` / `UNREAD_KEYS` entry of a config: its task, with distillation's mode beyond offline."""
  return cfg.task if cfg.task != "distill" or cfg.distill.mode == "offline" else f"distill:{cfg.distill.mode}"


def defaults() -> ml_collections.ConfigDict:
  """Every key of the run config with its default: configs/*.py start from it and state only what they change."""
  return sections.defaults(RunConfig())


def validate(values, num_devices: int) -> RunConfig:
  """ConfigDict -> RunConfig, plus the checks that involve several sections and the machine."""
  grpo = values.get("grpo") if hasattr(values, "get") else None
  moved = [k for k in rl_config.MOVED if k in (grpo or {})]
  if moved:
    also = "".join(f"; grpo.{k} is now {rl_config.MOVED[k]}" for k in moved[1:])
    raise ConfigError(f"config.grpo.{moved[0]}: moved to config.{rl_config.MOVED[moved[0]]} (the section of the code "
                      f"that reads it){also}")
  cfg = sections.to_dataclass(RunConfig, values)
  t, m = cfg.train, cfg.mesh
  if cfg.optim.warmup_steps > t.steps and cfg.task not in ("rollout", "eval"):  # a run cut short on the command line
    say(f"warning: config.optim.warmup_steps={cfg.optim.warmup_steps} is more than train.steps={t.steps}: the "
        f"warmup is clipped to {t.steps} steps")
  if len(m.shape) not in (3, 4, 5) or any(s == 0 or s < -1 for s in m.shape) or list(m.shape).count(-1) > 1:
    raise ConfigError(f"config.mesh.shape={m.shape}: {MESH_SHAPE}; sizes must be positive, with at most one -1 (the "
                      "rest)")
  fixed = 1
  for s in m.shape:
    fixed *= s if s != -1 else 1
  if fixed > num_devices or (-1 in m.shape and num_devices % fixed):
    raise ConfigError(f"config.mesh.shape={m.shape} needs {fixed} devices{'' if -1 not in m.shape else ' x k'}; "
                      f"{num_devices} are available")
  sizes = [s if s != -1 else num_devices // fixed for s in m.shape]
  dp = sizes[0] * sizes[1] * (sizes[3] if len(sizes) > 3 else 1)  # data x fsdp x expert
  _check_reads(cfg)
  key = reads_key(cfg)
  if "train" in READS[key] and "batch_size" not in UNREAD_KEYS.get(key, {}).get("train", {}) and \
      t.batch_size % (dp * t.micro_batches):
    raise ConfigError(f"config.train.batch_size={t.batch_size} is not divisible by data-parallel size "
                      f"(data x fsdp x expert = {dp}) x train.micro_batches={t.micro_batches}; accepted: multiples of "
                      f"{dp * t.micro_batches}")
  cfg.data.check("grpo" if key == "distill:on_policy" else cfg.task, t.seq_len)
  if cfg.task == "rm":
    cfg.rm.check(export_hf=cfg.checkpoint.export_hf)
  if cfg.task == "dpo":
    cfg.dpo.check()
  if key in ("rollout", "grpo", "ppo", "distill:gkd", "distill:on_policy"):
    cfg.sampling.check()
  if cfg.task in ("rollout", "grpo", "ppo"):
    cfg.rollout.check(cfg.task, cfg.run_dir)
    cfg.rollout.check_teacher()
    cfg.reward.check()
  if cfg.task in ("grpo", "ppo"):
    rl_config.check(cfg, dp)
  if cfg.task == "distill":
    stored = {"on_policy": bool(cfg.grpo.buffer), "offline": True, "gkd": False}[cfg.distill.mode]
    if not cfg.distill.teacher and not stored:  # offline: data with stored top-k is checked as the run starts
      raise ConfigError("config.distill.teacher: empty; name the teacher's HF checkpoint directory or .gguf file (or, "
                        "on-policy, set grpo.buffer to a replay buffer written with rollout.teacher)")
    if cfg.distill.mode == "gkd" and cfg.data.packing:
      raise ConfigError("config.data.packing=True with distill.mode='gkd': the student re-samples each row's "
                        "completion, so a row must hold one example; set data.packing=False")
    if cfg.distill.mode == "on_policy":
      cfg.reward.check()
      rl_config.check(on_policy_config(cfg), dp)
  _validate_lora(cfg)
  if cfg.task == "eval":
    cfg.eval.check(cfg.model.path)
  if not cfg.model.path and cfg.model.arch is None:
    raise ConfigError("config.model: set model.path (an HF checkpoint) or model.arch (a from-scratch architecture)")
  if not (cfg.tokenizer or cfg.model.path):
    raise ConfigError("config.tokenizer: empty and model.path is empty; name the tokenizer directory")
  from jalign.rewards.ensemble import is_ensemble
  if cfg.model.path and is_ensemble(cfg.model.path):
    raise ConfigError(f"config.model.path={cfg.model.path!r} is a reward-model ensemble (several checkpoints); use "
                      "one of its numbered member directories, or pass the ensemble as reward.model")
  return cfg


def _check_reads(cfg: RunConfig) -> None:
  """A ConfigError naming the first setting `cfg.task` (and mode) does not read (`READS`, `UNREAD_KEYS`) that differs
  from its default."""
  entry = reads_key(cfg)
  default, reads = RunConfig(), READS[entry]
  who = f"the {cfg.task} task" + ("" if entry == cfg.task else f" in mode {cfg.distill.mode!r}")
  for field in dataclasses.fields(RunConfig):
    section = getattr(cfg, field.name)
    if not dataclasses.is_dataclass(section):
      continue
    unread = {f.name: "" for f in dataclasses.fields(section)} if field.name not in reads else \
        UNREAD_KEYS.get(entry, {}).get(field.name, {})
    for key, instead in unread.items():
      value, base = getattr(section, key), getattr(getattr(default, field.name), key)
      if value != base:
        what = f"config.{field.name}.{key}; {instead}" if instead else \
            f"config.{field.name} (it reads {', '.join(reads)})"
        raise ConfigError(f"config.{field.name}.{key}={value!r}: {who} does not read {what}. Leave it at its "
                          f"default ({base!r}) or remove the setting")


def on_policy_config(cfg: RunConfig) -> RunConfig:
  """The RL config on-policy distillation runs the GRPO update with: the teacher is the reference, its per-token
  reverse KL (k1, `distill.coef`) the reward; the advantages are distillation's own
  (`losses.distill.on_policy_advantages`)."""
  return dataclasses.replace(cfg, kl=KlSection(coef=cfg.distill.coef, kind="k1", in_reward=True))


def check_paths(cfg: RunConfig) -> None:
  """The local files and directories the config names exist (a pipeline checks its stages' as they start: a later
  stage's model is the previous stage's export)."""
  named = {"model.path": cfg.model.path, "tokenizer": cfg.tokenizer, "reward.model": cfg.reward.model,
           "eval.reference": cfg.eval.reference if cfg.task == "eval" else "",
           "eval.reward_model": cfg.eval.reward_model if cfg.task == "eval" else "",
           "distill.teacher": cfg.distill.teacher, "distill.teacher_tokenizer": cfg.distill.teacher_tokenizer,
           "rollout.teacher": cfg.rollout.teacher}
  for key, path in named.items():
    if path and "://" not in path and not os.path.exists(path):
      raise ConfigError(f"config.{key}={path!r}: not found (no such file or directory)")


def _validate_lora(cfg: RunConfig) -> None:
  lo = cfg.model.lora
  if cfg.model.offload_reference:
    if lo.rank:
      raise ConfigError("config.model.offload_reference=True with model.lora.rank > 0: with adapters the reference "
                        "is the base weights the policy trains on, already on the device; set one of them off")
    if cfg.task == "dpo" and cfg.dpo.sync_ref_model:
      raise ConfigError("config.model.offload_reference=True with dpo.sync_ref_model=True: the synced reference is "
                        "updated every few steps on the device; set one of them off")
    if cfg.task not in ("dpo", "grpo", "ppo"):
      raise ConfigError(f"config.model.offload_reference=True: task {cfg.task!r} has no reference model (dpo, grpo "
                        "and ppo do)")
  if lo.rank < 0 or lo.alpha <= 0 or not 0 <= lo.dropout < 1:
    raise ConfigError(f"config.model.lora: rank={lo.rank}, alpha={lo.alpha}, dropout={lo.dropout}; accepted: rank >= 0 "
                      "(0 = off), alpha > 0, 0 <= dropout < 1")
  if not lo.rank:
    return
  from jalign.models.lora import resolve_targets
  try:
    resolve_targets(lo.targets)
  except ValueError as e:
    raise ConfigError(f"config.model.lora.targets: {e}") from None
  if cfg.task == "dpo" and cfg.dpo.sync_ref_model:
    # TRL likewise refuses TR-DPO's sync without a separate reference model (the PEFT case).
    raise ConfigError("config.dpo.sync_ref_model=True with model.lora.rank > 0: with adapters the reference is the "
                      "base model with adapters off, which does not move; set one of them off")
  if cfg.task == "rollout":
    raise ConfigError("config.model.lora.rank > 0 with task 'rollout': sampling trains nothing; set rank 0 (an "
                      "adapter run exports merged weights to load here)")


def as_dict(cfg) -> dict[str, Any]:
  """JSON-friendly dict of a RunConfig (stored in checkpoints)."""
  return dataclasses.asdict(cfg)


def reference_page() -> str:
  """docs/config.md: every key of the run config from the section dataclasses (`python -m jalign.config`)."""
  return "\n".join([
      "# Config reference", "",
      "Every key of a run config: its type, default, bounds and meaning, generated from the section dataclasses",
      "(`python -m jalign.config > docs/config.md`; a test fails when this page is stale). A config file",
      "(`configs/<task>.py`) starts from these defaults and states what it changes; `--config.<key>=<value>` overrides",
      "any key on the command line and `--list_keys` prints a config's values. A chain (`configs/pipeline.py`) has",
      "its own keys (task, run_dir, base_model, order, rm_weight, stages, eval, distributed); each stage is a run",
      "config.", "",
      "A task reads only some sections; a value other than the default in one it does not read is an error (as is",
      "one in the keys a task leaves to its own section), never a setting dropped without a word:", "",
      "| task | sections it reads | keys it does not read |", "| --- | --- | --- |",
      *(f"| {task} | {', '.join(reads)} | "
        f"{', '.join(f'{s}.{k} ({why})' for s, keys in UNREAD_KEYS.get(task, {}).items() for k, why in keys.items())} |"
        for task, reads in READS.items()), "",
      *sections.reference(RunConfig), ""])


if __name__ == "__main__":
  print(reference_page(), end="")
