"""Typed run configuration: an `ml_collections.ConfigDict` validated into frozen dataclasses at the boundary.

Every key is checked: an unknown key, a wrong type or a value outside its accepted set is a `ConfigError` naming the
dotted key (`config.train.batch_size`) and what is accepted. Jitted code only ever sees these dataclasses.
"""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from typing import Any, Literal

import ml_collections

from jalign.data.layouts import Fields
from jalign.errors import ConfigError
from jalign.losses.dpo import PAIRED, REFERENCE_FREE
from jalign.models.config import ModelConfig
from jalign.models.lora import LoraConfig
from jalign.models.sharding import DEFAULT_RULES
from jalign.parallel.distributed import DistributedSection


@dataclasses.dataclass(frozen=True)
class ModelSection:
  path: str = ""                       # HF checkpoint directory; "" = initialise `arch` from scratch
  arch: ModelConfig | None = None      # architecture for a from-scratch model
  dtype: Literal["float32", "bfloat16"] = "float32"           # parameters
  compute_dtype: Literal["", "float32", "bfloat16"] = ""       # activations; "" = dtype
  scan_layers: bool = True
  remat: Literal["none", "full", "dots"] = "none"
  attention: Literal["auto", "xla", "chunked", "splash", "cudnn"] = "auto"  # `kernels.attention` impl
  lora: LoraConfig = LoraConfig()      # low-rank adapters; rank 0 = full fine-tuning
  offload_reference: bool = False      # DPO / GRPO / PPO: keep the frozen reference in host memory, copied to the
                                       # device only for its forward passes

  def knobs(self) -> dict:
    """The runtime fields of `ModelConfig` this section sets on a loaded or created model."""
    return dict(scan_layers=self.scan_layers, remat=self.remat, attention=self.attention)


@dataclasses.dataclass(frozen=True)
class DataSection:
  train: str = ""                      # file / glob / list, tfds:NAME:SPLIT@DIR, or synthetic:TASK:SPLIT
  eval: str = ""
  max_length: int = 512                # tokens per example after truncation
  truncation: Literal["keep_start", "keep_end", "drop"] = "keep_start"
  packing: bool = True
  buckets: tuple[int, ...] = ()        # unpacked padding lengths; () = train.seq_len
  shuffle: bool = True
  skip_bad_records: bool = False
  read_threads: int = 0               # grain reading threads (raise for remote storage); 0 = on demand
  num_packing_bins: int = 0            # 0 = rows per process batch
  pair_checks: Literal["warn", "error", "off"] = "warn"   # preference data: identical pairs, repeated prompts,
                                                          # chosen/rejected length imbalance, checked before training
  max_length_ratio: float = 1.5        # chosen/rejected mean-length ratio beyond which pair_checks reports it
  pairs_per_prompt: int = 1            # pairs one prompt may have before pair_checks reports repeated prompts
  check_records: int = 0               # records read by the pair checks; 0 = all
  # how a dataset's records map onto TRL's layouts (jalign.data.layouts): "auto" recognises GSM8K, MATH, HH-RLHF,
  # UltraFeedback, ShareGPT and LLaMA-Factory KTO records; "none" reads records as they are
  layout: Literal["auto", "none", "gsm8k", "math", "hh_rlhf", "ultrafeedback", "sharegpt", "kto_messages"] = "auto"
  prompt_key: str = ""                 # field holding the prompt (verl's data.prompt_key); "" = by layout
  answer_key: str = ""                 # field holding the ground truth, dotted for nested fields (verl's
                                       # "reward_model.ground_truth"); "" = by layout
  prompt_suffix: str = ""              # appended to every prompt's last user turn (an answer-format instruction)

  def fields(self) -> Fields:
    return Fields(self.layout, self.prompt_key, self.answer_key, self.prompt_suffix)


@dataclasses.dataclass(frozen=True)
class TrainSection:
  steps: int = 1000
  batch_size: int = 32                 # global rows per optimizer step (packed rows when packing)
  micro_batches: int = 1               # gradient accumulation: a lax.scan over this many slices
  seq_len: int = 512
  log_every: int = 10
  eval_every: int = 0                  # 0 = only at the end
  eval_batches: int = 8
  eval_examples: int = 256             # held-out task accuracy (generative check) at eval time
  nonfinite: Literal["stop", "skip"] = "stop"   # a NaN/Inf loss or gradient: the update is never applied; then
                                       # stop naming the step and its records, or skip on (counted)


@dataclasses.dataclass(frozen=True)
class OptimSection:
  lr: float = 1e-4
  schedule: Literal["cosine", "linear", "constant"] = "cosine"
  warmup_steps: int = 0
  min_lr_ratio: float = 0.0            # cosine/linear end value as a fraction of lr
  weight_decay: float = 0.0            # AdamW, not applied to norm scales and biases
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  clip_norm: float = 1.0               # global-norm clipping; 0 = off


@dataclasses.dataclass(frozen=True)
class MeshSection:
  shape: tuple[int, int, int] = (1, -1, 1)   # ('data', 'fsdp', 'tensor'); -1 = the remaining devices; without
                                             # -1, a mesh smaller than the machine uses the first devices
  rules: tuple = DEFAULT_RULES               # logical axis -> mesh axis / tuple of axes / None


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
  every: int = 0                       # steps between checkpoints; 0 = only at the end (and on SIGTERM)
  keep: int = 3
  resume: bool = True                  # continue from the newest complete checkpoint in run_dir
  export_hf: bool = True               # write an HF checkpoint to run_dir/hf at the end
  async_save: bool = True
  preempt_grace_s: float = 30.0        # after SIGTERM: save within this long or exit 143 anyway (spot VMs and
                                       # Kubernetes give 30 s before SIGKILL); 0 = no limit


@dataclasses.dataclass(frozen=True)
class LogSection:
  progress: bool = True                # console progress bar with ETA
  jsonl: bool = True                   # run_dir/metrics.jsonl
  tensorboard: bool = True             # run_dir/tensorboard (tensorboardX, when installed)
  wandb: bool = False                  # when wandb is installed
  wandb_project: str = "jalign"
  peak_flops: float = 0.0              # per device, for MFU; 0 = from the device kind when known


@dataclasses.dataclass(frozen=True)
class LogprobSection:
  impl: Literal["xla", "chunked", "pallas_gpu", "pallas_tpu", "auto"] = "auto"  # auto: xla up to 4096 columns,
                                       # then pallas_tpu for TPU targets, chunked elsewhere
  chunk: int = 0                       # vocabulary columns per chunk (chunked); 0 = from a 64 MiB budget
  blocks: tuple[int, ...] = ()         # Pallas tile (tokens, vocab, model-dim slice or 0); () = per-chip defaults
  interpret: bool = False              # Pallas in interpret mode (any backend; slow; for checking)

  def options(self):
    from jalign.kernels import LogprobOptions
    return LogprobOptions(**dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True)
class SamplingSection:
  max_new_tokens: int = 32
  temperature: float = 1.0
  top_k: int = 0                       # 0 = off
  top_p: float = 1.0
  min_p: float = 0.0
  num_samples: int = 4                 # completions per prompt (a GRPO group)
  max_prompt_length: int = 64
  layout: Literal["training", "no_fsdp"] = "training"   # weight layout while generating (see models.without_fsdp)


@dataclasses.dataclass(frozen=True)
class RewardSection:
  weights: tuple = (("gsm8k", 1.0),)   # (name, weight) pairs from jalign.rl.rewards.REGISTRY
  model: str = ""                      # a reward model: an HF *ForSequenceClassification dir, or an ensemble dir
                                       # (configs/rm.py's run_dir/ensemble)
  model_weight: float = 1.0            # its score's weight in the reward
  overlong_max_length: int = 0         # DAPO overlong penalty; 0 = off
  overlong_buffer: int = 0
  length_target: int = 0               # linear length penalty; 0 = off
  length_weight: float = 0.0


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  prompts: str = ""                    # prompt source (same specs as data.train)
  output: str = ""                     # buffer directory inside run_dir (relative to it); "" = run_dir/buffer
  format: Literal["parquet", "arrayrecord"] = "parquet"
  prompts_per_batch: int = 16
  limit: int = 0                       # first N prompts only; 0 = all
  min_reward: float | None = None      # drop trajectories scoring below this


@dataclasses.dataclass(frozen=True)
class GrpoSection:
  prompts: str = ""                    # training prompts (same specs as data.train)
  buffer: str = ""                     # offline mode: a replay buffer directory from the rollout task
  prompts_per_step: int = 16           # x sampling.num_samples completions per step
  mini_batches: int = 1                # optimizer updates per epoch over the step's completions
  ppo_epochs: int = 1
  # grpo / drgrpo / rloo: group baselines; gae: PPO with a learned critic; reinforce_pp(_baseline): REINFORCE++;
  # remax: each prompt's greedy response, sampled and scored alongside, is the baseline (Li et al. 2023).
  adv_estimator: Literal["grpo", "drgrpo", "rloo", "gae", "reinforce_pp", "reinforce_pp_baseline",
                         "remax"] = "grpo"
  gamma: float = 1.0                   # discount (verl algorithm.gamma)
  lam: float = 1.0                     # GAE lambda (verl algorithm.lam)
  clip_low: float = 0.2
  clip_high: float = 0.28              # DAPO clip-higher (Yu et al. 2025); 0.2 = symmetric PPO
  clip_c: float | None = None          # dual clip (Ye et al. 2020); None = off
  loss_mode: Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"] = "vanilla"
                                       # verl's loss_mode names; see losses.policy.policy_loss_matrix (clip_low /
                                       # clip_high: log-ratio bounds for geo_mean, divergence thresholds for dppo_*)
  tau_pos: float = 1.0                 # sapo's gate temperature where A > 0 (verl actor.tau_pos)
  tau_neg: float = 1.05                # ... where A <= 0 (verl actor.tau_neg)
  agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
  loss_scale_factor: int = 0           # seq-mean-token-sum-norm's constant T (verl's name); 0 = max_new_tokens
  kl_coef: float = 0.001               # KL(pi || ref) in the loss (verl use_kl_loss, low_var_kl); 0 = no KL term
                                       # (DAPO): the reference then runs only on the steps that log the KL
  kl_kind: Literal["k1", "abs", "k2", "k3"] = "k3"
  kl_in_reward: bool = False           # subtract kl_coef x KL(old || ref) from token rewards instead (verl
                                       # use_kl_in_reward); the KL loss term is then off
  kl_ctrl: Literal["fixed", "adaptive"] = "fixed"   # adaptive (Ziegler et al. 2019) steers the in-reward kl_coef
  kl_target: float = 0.1               # adaptive: target KL per token (verl kl_ctrl.target_kl)
  kl_horizon: int = 10000              # adaptive: horizon in rollouts (verl kl_ctrl.horizon)
  entropy_coef: float = 0.0
  critic_lr: float = 1e-5              # gae: the critic's own AdamW learning rate (verl critic.optim.lr)
  value_clip: float = 0.5              # gae: clip of the value update around the rollout values (verl)
  critic_warmup: int = 0               # gae: first steps update only the critic (verl trainer.critic_warmup)
  dynamic_sampling: bool = False       # DAPO: drop groups whose rewards are all equal (out of the loss) ...
  max_gen_batches: int = 1             # ... and sample up to this many prompt batches per step to refill
                                       # prompts_per_step informative groups (verl filter_groups.max_num_gen_batches)
  compact_sizes: int = 0               # > 0: the update leaves the dropped groups out of its batch instead of masking
                                       # them (less work, same loss), padded to a multiple of prompts_per_step /
                                       # compact_sizes groups: at most this many batch shapes, each compiled once
  share_prompts: bool = True           # each prompt runs through the model once per group in the update (its
                                       # keys/values shared by the group's samples; mini-batches then hold whole
                                       # groups, which needs mini_batches to divide prompts_per_step); not with remat
  eval_prompts: str = ""               # held-out prompts for greedy accuracy; "" = none
  eval_examples: int = 500
  max_kl: float = 0.0                  # bound on the mean KL to the reference; 0 = off
  max_kl_action: Literal["stop", "lower_lr"] = "stop"   # past max_kl: checkpoint and stop, or lower the lr
  kl_lr_factor: float = 0.5            # lower_lr: multiply the learning rate by this at each breach
  entropy_floor: float = 0.01          # warn (monitor/entropy_collapse) below this mean token entropy; 0 = off
  # a step whose advantages are all 0 (every group's rewards equal) carries no signal: "skip" leaves its update out
  # (the KL / entropy terms alone would only pull the policy toward the reference), "update" runs it as peers do
  no_signal: Literal["skip", "update"] = "skip"
  no_signal_warn_steps: int = 5        # warn once when the run's first N steps all carried no signal; 0 = off
  # Offline: truncated importance sampling (TIS; Yao et al. 2025, verl actor.tis_imp_ratio_cap). > 0: the clipped
  # ratio is taken against the policy as it was before the step's update, and each token's loss is weighted by
  # min(pi_old / pi_behaviour, cap), the stored behaviour log-probs correcting for the data's staleness. 0 = off:
  # the clipped ratio is taken against the behaviour log-probs themselves.
  tis_imp_ratio_cap: float = 0.0

  @property
  def updates_per_step(self) -> int:
    """Optimizer updates per training step (policy and critic alike)."""
    return self.mini_batches * self.ppo_epochs


@dataclasses.dataclass(frozen=True)
class RewardMember:
  """A further reward model of an ensemble: trained like the run's own model (same backbone, head and optimizer) on
  its own pairs, for its own steps; the ensemble's score adds `weight` x its score to the run's model's."""
  train: str = ""                      # its training pairs (the forms of data.train)
  steps: int = 0
  weight: float = 1.0


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
  head: Literal["linear", "mlp"] = "linear"    # scalar head on the last real token's hidden state
  head_bias: bool = False              # HF *ForSequenceClassification has none; export needs linear, no bias
  mlp_size: int = 0                    # mlp head width; 0 = hidden size
  center_rewards_coefficient: float = 0.0   # TRL: + coef * (r_c + r_r)^2 (Eisenstein et al. 2023); 0 = off
  share_prompt: bool = True            # each pair's prompt runs once, under both completions (prefix sharing)
  members: tuple[RewardMember, ...] = ()    # () = one reward model; else an ensemble: the run's model + these,
                                            # scores summed (jalign/train/reward.py)


# Advantage estimators whose values for one group depend on that group's samples alone (no batch whitening, no
# critic): leaving other groups out of the batch does not change them.
GROUP_LOCAL_ESTIMATORS = ("grpo", "drgrpo", "rloo", "remax")

DPO_LOSS_TYPES = PAIRED + REFERENCE_FREE + ("kto",)


@dataclasses.dataclass(frozen=True)
class DpoSection:
  loss_type: Literal[DPO_LOSS_TYPES] = "sigmoid"   # simpo / cpo / orpo need no reference model
  beta: float = 0.1                    # (orpo: lambda; simpo: its beta, ~2)
  label_smoothing: float = 0.0         # sigmoid: conservative DPO; robust / exo_pair: the noise level
  simpo_gamma: float = 0.5             # SimPO target reward margin
  cpo_alpha: float = 1.0               # CPO: weight of the chosen NLL
  discopop_tau: float = 0.05
  rpo_alpha: float = 0.0               # RPO (Pang et al. 2024): + alpha x token-mean NLL of the chosen; 0 = off
  desirable_weight: float = 1.0        # KTO (unpaired prompt/completion/label data, or pairs split in two)
  undesirable_weight: float = 1.0
  precompute_ref_logps: bool = False   # one reference pass over the data before training, then no reference forward
  share_prompt: bool = True            # each pair's prompt runs once, under both completions (prefix sharing)
  sync_ref_model: bool = False         # TR-DPO (Gorbatovski et al. 2024): ref = a * policy + (1 - a) * ref ...
  ref_model_mixup_alpha: float = 0.6
  ref_model_sync_steps: int = 512      # ... every this many steps
  eval_prompts: str = ""               # held-out prompts for greedy task accuracy (needs a ground truth); "" = none
  eval_examples: int = 500
  eval_max_new_tokens: int = 16


@dataclasses.dataclass(frozen=True)
class EvalSection:
  """Held-out evaluation of a checkpoint (jalign.eval.policy)."""
  prompts: str = "synthetic:arith:test"   # held-out prompts with ground truth (any prompt source jalign reads)
  examples: int = 256                  # prompts evaluated (the first ones)
  metric: str = "gsm8k"                # the verifier: a verifiable reward of jalign.rl.rewards
  max_new_tokens: int = 16
  num_samples: int = 0                 # n samples per prompt for pass@k; 0 = greedy only
  pass_k: tuple[int, ...] = (1,)       # k values for pass@k (each <= num_samples)
  temperature: float = 1.0             # of the samples (pass@k and the KL estimate)
  reference: str = ""                  # HF dir of a reference policy: win rate and KL against it
  reward_model: str = ""               # HF *ForSequenceClassification or ensemble dir: mean score (and judge)
  judge: Literal["auto", "reward_model", "verifier"] = "auto"   # win rate judge; auto = the reward model if any
  sft_data: str = ""                   # held-out SFT data: perplexity
  pairs: str = ""                      # held-out preference pairs: the reward model's pairwise accuracy, Spearman
  batch_size: int = 128
  seed: int = 0


@dataclasses.dataclass(frozen=True)
class RunConfig:
  task: Literal["sft", "rollout", "grpo", "ppo", "rm", "dpo", "eval"] = "sft"
  run_dir: str = "runs/default"
  seed: int = 0
  tokenizer: str = ""                  # directory with tokenizer.json; "" = model.path
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  train: TrainSection = TrainSection()
  optim: OptimSection = OptimSection()
  mesh: MeshSection = MeshSection()
  checkpoint: CheckpointSection = CheckpointSection()
  log: LogSection = LogSection()
  logprobs: LogprobSection = LogprobSection()
  sampling: SamplingSection = SamplingSection()
  reward: RewardSection = RewardSection()
  rollout: RolloutSection = RolloutSection()
  grpo: GrpoSection = GrpoSection()
  rm: RewardModelSection = RewardModelSection()
  dpo: DpoSection = DpoSection()
  distributed: DistributedSection = DistributedSection()   # multi-process start-up (jalign.parallel.distributed)
  eval: EvalSection = EvalSection()    # held-out evaluation of a checkpoint (jalign.eval.policy)


# ----------------------------------------------------------------------------------------------------------------

def _describe(tp) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin in (typing.Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if origin is tuple:
    return "a tuple"
  if dataclasses.is_dataclass(tp):
    return f"a section ({tp.__name__})"
  return getattr(tp, "__name__", str(tp))


def _convert(value, tp, key: str):
  origin = typing.get_origin(tp)
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # Optional[X]: X's own error is the helpful one
      return _convert(value, options[0], key)
    for a in options:
      try:
        return _convert(value, a, key)
      except ConfigError:
        pass
    raise ConfigError(f"{key}: {value!r:.60} is not {_describe(tp)}")
  if origin is Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{key}: {value!r} is not accepted; accepted: "
                        + ", ".join(repr(a) for a in typing.get_args(tp)))
    return value
  if dataclasses.is_dataclass(tp):
    return to_dataclass(tp, value, key)
  if origin is tuple:
    if not isinstance(value, (tuple, list)):
      raise ConfigError(f"{key}: expected a tuple, found {type(value).__name__} {value!r:.60}")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
      return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    if args and len(args) != len(value):
      raise ConfigError(f"{key}: expected {len(args)} entries, found {len(value)}")
    if args:
      return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    return tuple(tuple(v) if isinstance(v, list) else v for v in value)
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}: expected True or False, found {type(value).__name__} {value!r:.60}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}: expected an integer, found {type(value).__name__} {value!r:.60}")
    return value
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}: expected a number, found {type(value).__name__} {value!r:.60}")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}: expected a string, found {type(value).__name__} {value!r:.60}")
    return value
  return value


def defaults(section=None) -> ml_collections.ConfigDict:
  """Every key of the run config (or of a section instance) with its default, as a ConfigDict: configs/*.py start
  from it and state only what their recipe changes, and any key can be set on the command line. An unset optional
  number is a typed placeholder (`--config.grpo.clip_c=3` works); an unset optional section (`model.arch`) is None
  until a config gives it."""
  section = RunConfig() if section is None else section
  hints = typing.get_type_hints(type(section))
  out = {}
  for f in dataclasses.fields(section):
    if not f.init:
      continue
    value = getattr(section, f.name)
    if dataclasses.is_dataclass(value):
      out[f.name] = defaults(value)
    elif value is None:
      scalar = [a for a in typing.get_args(hints[f.name]) if a in (int, float, str, bool)]
      out[f.name] = ml_collections.config_dict.placeholder(scalar[0]) if scalar else None
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)


def to_dataclass(cls, values, key: str = "config"):
  """Builds dataclass `cls` from a mapping (ConfigDict or dict), checking every key and type."""
  if dataclasses.is_dataclass(values) and isinstance(values, cls):
    return values
  if hasattr(values, "to_dict"):
    values = values.to_dict()
  if not isinstance(values, dict):
    raise ConfigError(f"{key}: expected a section of keys ({cls.__name__}), found {type(values).__name__}")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"{key}.{unknown[0]}: unknown key; accepted keys of {key}: {', '.join(sorted(fields))}")
  kwargs = {name: _convert(v, hints[name], f"{key}.{name}") for name, v in values.items()}
  try:
    return cls(**kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"{key}: {e}") from None


def validate(values, num_devices: int) -> RunConfig:
  """ConfigDict -> RunConfig, plus the checks that involve several keys and the machine."""
  cfg = to_dataclass(RunConfig, values)
  t, d, m = cfg.train, cfg.data, cfg.mesh
  positive = {"config.train.steps": t.steps, "config.train.batch_size": t.batch_size,
              "config.train.micro_batches": t.micro_batches, "config.train.seq_len": t.seq_len,
              "config.train.log_every": t.log_every, "config.data.max_length": d.max_length,
              "config.checkpoint.keep": cfg.checkpoint.keep}
  for key, v in positive.items():
    if v <= 0:
      raise ConfigError(f"{key}={v}: must be positive")
  if cfg.optim.lr <= 0:
    raise ConfigError(f"config.optim.lr={cfg.optim.lr}: must be positive")
  if not 0 <= cfg.optim.warmup_steps <= t.steps:
    raise ConfigError(f"config.optim.warmup_steps={cfg.optim.warmup_steps}: must be in [0, train.steps={t.steps}]")
  if any(s == 0 or s < -1 for s in m.shape) or list(m.shape).count(-1) > 1:
    raise ConfigError(f"config.mesh.shape={m.shape}: sizes must be positive, with at most one -1 (the rest)")
  fixed = 1
  for s in m.shape:
    fixed *= s if s != -1 else 1
  if fixed > num_devices or (-1 in m.shape and num_devices % fixed):
    raise ConfigError(f"config.mesh.shape={m.shape} needs {fixed} devices{'' if -1 not in m.shape else ' x k'}; "
                      f"{num_devices} are available")
  sizes = [s if s != -1 else num_devices // fixed for s in m.shape]
  dp = sizes[0] * sizes[1]
  if t.batch_size % (dp * t.micro_batches):
    raise ConfigError(f"config.train.batch_size={t.batch_size} is not divisible by data-parallel size "
                      f"(data x fsdp = {dp}) x train.micro_batches={t.micro_batches}; accepted: multiples of "
                      f"{dp * t.micro_batches}")
  if cfg.task == "sft" and d.packing and d.max_length > t.seq_len:
    raise ConfigError(f"config.data.max_length={d.max_length} exceeds config.train.seq_len={t.seq_len}: a packed "
                      "example must fit one row")
  if d.read_threads < 0:
    raise ConfigError(f"config.data.read_threads={d.read_threads} must be >= 0 (0 = read on demand)")
  if d.buckets and max(d.buckets) > t.seq_len:
    raise ConfigError(f"config.data.buckets={d.buckets}: largest bucket exceeds train.seq_len={t.seq_len}")
  if cfg.task in ("sft", "rm", "dpo") and not d.train:
    raise ConfigError("config.data.train: empty; give a data file/glob, tfds:NAME:SPLIT@DIR or synthetic:TASK")
  if cfg.task in ("rm", "dpo"):
    _validate_preference(cfg)
  if cfg.task in ("rollout", "grpo", "ppo"):
    _validate_rollout(cfg)
  if cfg.task in ("grpo", "ppo"):
    _validate_grpo(cfg)
    mb_rows = cfg.grpo.prompts_per_step * cfg.sampling.num_samples // cfg.grpo.mini_batches
    if mb_rows % dp:
      raise ConfigError(f"config.grpo: {mb_rows} completions per mini-batch do not split over data-parallel size "
                        f"(data x fsdp = {dp}); change grpo.prompts_per_step, sampling.num_samples, "
                        "grpo.mini_batches or mesh.shape")
    g = cfg.grpo
    unit_rows = g.prompts_per_step // g.compact_sizes * cfg.sampling.num_samples // g.mini_batches \
        if g.compact_sizes > 0 else 0
    if unit_rows % dp:
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: a size step of {unit_rows} completions per "
                        f"mini-batch does not split over data-parallel size (data x fsdp = {dp}); use fewer sizes")
  _validate_lora(cfg)
  if cfg.task == "eval":
    _validate_eval(cfg)
  if not cfg.model.path and cfg.model.arch is None:
    raise ConfigError("config.model: set model.path (an HF checkpoint) or model.arch (a from-scratch architecture)")
  if not (cfg.tokenizer or cfg.model.path):
    raise ConfigError("config.tokenizer: empty and model.path is empty; name the tokenizer directory")
  from jalign.objectives.reward import is_ensemble
  if cfg.model.path and is_ensemble(cfg.model.path):
    raise ConfigError(f"config.model.path={cfg.model.path!r} is a reward-model ensemble (several checkpoints); use "
                      "one of its numbered member directories, or pass the ensemble as reward.model")
  return cfg


def _validate_eval(cfg: RunConfig) -> None:
  e = cfg.eval
  if not cfg.model.path:
    raise ConfigError("config.model.path: empty; task 'eval' evaluates an HF checkpoint directory")
  if e.examples <= 0 or e.max_new_tokens <= 0 or e.batch_size <= 0 or e.num_samples < 0:
    raise ConfigError("config.eval: examples, max_new_tokens and batch_size must be positive, num_samples >= 0")
  if e.num_samples and any(k < 1 or k > e.num_samples for k in e.pass_k):
    raise ConfigError(f"config.eval.pass_k={e.pass_k}: each k must be in [1, eval.num_samples={e.num_samples}]")
  if (e.num_samples or e.reference) and e.temperature <= 0:
    raise ConfigError(f"config.eval.temperature={e.temperature}: samples (pass@k, the KL estimate) need a "
                      "temperature > 0")
  if e.judge == "reward_model" and not e.reward_model:
    raise ConfigError("config.eval.judge='reward_model' needs config.eval.reward_model")
  from jalign.rl.rewards import NEEDS_GROUND_TRUTH
  if e.metric not in NEEDS_GROUND_TRUTH:
    raise ConfigError(f"config.eval.metric={e.metric!r}; accepted verifiers: {', '.join(sorted(NEEDS_GROUND_TRUTH))}")


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


def _validate_preference(cfg: RunConfig) -> None:
  d, r, p = cfg.data, cfg.rm, cfg.dpo
  if d.packing:
    raise ConfigError(f"config.data.packing=True: {cfg.task} batches whole preference pairs padded to a bucket, not "
                      "packed; set data.packing=False")
  if d.max_length > cfg.train.seq_len:
    raise ConfigError(f"config.data.max_length={d.max_length} exceeds config.train.seq_len={cfg.train.seq_len}: "
                      "a pair's sequences must fit one row")
  if d.max_length_ratio < 1:
    raise ConfigError(f"config.data.max_length_ratio={d.max_length_ratio}: must be >= 1")
  if d.pairs_per_prompt < 1:
    raise ConfigError(f"config.data.pairs_per_prompt={d.pairs_per_prompt}: must be >= 1")
  if cfg.task == "rm":
    if r.center_rewards_coefficient < 0 or r.mlp_size < 0:
      raise ConfigError("config.rm.center_rewards_coefficient and config.rm.mlp_size must be >= 0")
    if cfg.checkpoint.export_hf and (r.head != "linear" or r.head_bias):
      raise ConfigError(f"config.rm.head={r.head!r}, head_bias={r.head_bias}: an HF sequence-classification "
                        "checkpoint holds one linear score without bias; use rm.head='linear', rm.head_bias=False or "
                        "set checkpoint.export_hf=False")
    for i, m in enumerate(r.members):
      key = f"config.rm.members[{i}]"
      if not m.train:
        raise ConfigError(f"{key}.train is empty: each member needs its training pairs (a file, glob or tfds spec)")
      if m.steps <= 0 or cfg.optim.warmup_steps > m.steps:
        raise ConfigError(f"{key}.steps={m.steps}: must be positive and >= optim.warmup_steps="
                          f"{cfg.optim.warmup_steps}")
      if not (math.isfinite(m.weight) and m.weight > 0):
        raise ConfigError(f"{key}.weight={m.weight}: must be a positive number")
    if r.members and not cfg.checkpoint.export_hf:
      raise ConfigError("config.rm.members: the ensemble is assembled from each member's exported checkpoint; set "
                        "checkpoint.export_hf=True")
    return
  if p.beta <= 0:
    raise ConfigError(f"config.dpo.beta={p.beta}: must be positive")
  if p.loss_type == "exo_pair" and not 0 < p.label_smoothing < 1:
    raise ConfigError("config.dpo.label_smoothing: loss_type 'exo_pair' needs 0 < label_smoothing < 1 (e.g. 1e-3)")
  if not 0 <= p.label_smoothing < 0.5:
    raise ConfigError(f"config.dpo.label_smoothing={p.label_smoothing}: must be in [0, 0.5)")
  if p.rpo_alpha < 0:
    raise ConfigError(f"config.dpo.rpo_alpha={p.rpo_alpha}: must be >= 0")
  if p.loss_type == "kto":
    if p.precompute_ref_logps:
      raise ConfigError("config.dpo.precompute_ref_logps=True: KTO's KL sequences pair each prompt with another "
                        "example's completion of the same batch, so their reference log-probs depend on batching; "
                        "set precompute_ref_logps=False")
    if p.rpo_alpha:
      raise ConfigError("config.dpo.rpo_alpha applies to paired losses, not loss_type='kto'")
    if p.desirable_weight <= 0 or p.undesirable_weight <= 0:
      raise ConfigError("config.dpo.desirable_weight and undesirable_weight must be positive")
  if p.sync_ref_model:
    if p.precompute_ref_logps:
      raise ConfigError("config.dpo.sync_ref_model=True with precompute_ref_logps=True: precomputed reference "
                        "log-probs go stale when the reference is synced; set one of them to False")
    if not 0 < p.ref_model_mixup_alpha <= 1 or p.ref_model_sync_steps <= 0:
      raise ConfigError("config.dpo: sync_ref_model needs 0 < ref_model_mixup_alpha <= 1 and "
                        "ref_model_sync_steps > 0")
    if p.loss_type in REFERENCE_FREE:
      raise ConfigError(f"config.dpo.sync_ref_model=True: loss_type {p.loss_type!r} uses no reference model")


def output_path(run_dir: str, path: str) -> str:
  """An output path resolved against the run directory (links included)."""
  return os.path.realpath(os.path.join(run_dir, path))


def inside(run_dir: str, path: str) -> bool:
  root = os.path.realpath(run_dir)
  return os.path.commonpath([root, output_path(run_dir, path)]) == root


def _validate_rollout(cfg: RunConfig) -> None:
  s, r = cfg.sampling, cfg.rollout
  if cfg.task == "rollout" and not r.prompts:
    raise ConfigError("config.rollout.prompts: empty; give a prompt file/glob, tfds:... or synthetic:TASK:SPLIT")
  if r.output and not inside(cfg.run_dir, r.output):
    raise ConfigError(f"config.rollout.output={r.output!r} resolves outside run_dir={cfg.run_dir!r}: a run writes "
                      "only inside its run directory; give a path relative to it (or run_dir itself)")
  for key, v in (("sampling.max_new_tokens", s.max_new_tokens), ("sampling.num_samples", s.num_samples),
                 ("sampling.max_prompt_length", s.max_prompt_length),
                 ("rollout.prompts_per_batch", r.prompts_per_batch)):
    if v <= 0:
      raise ConfigError(f"config.{key}={v}: must be positive")
  if s.temperature < 0 or not 0 < s.top_p <= 1 or not 0 <= s.min_p < 1 or s.top_k < 0:
    raise ConfigError(f"config.sampling: temperature >= 0, 0 < top_p <= 1, 0 <= min_p < 1, top_k >= 0 required "
                      f"(got {s.temperature}, {s.top_p}, {s.min_p}, {s.top_k})")
  from jalign.rl.rewards import RewardError
  w = cfg.reward
  if not w.weights and not w.model:
    raise ConfigError("config.reward: no reward configured; set reward.weights (verifiable rewards) and/or "
                      "reward.model (a reward model checkpoint)")
  if w.model:
    from jalign.models.hf import architectures
    from jalign.objectives.reward import ensemble_members, is_ensemble
    try:  # one checkpoint, or each member of an ensemble directory
      paths = [p for p, _ in ensemble_members(w.model)] if is_ensemble(w.model) else [w.model]
    except ValueError as e:
      raise ConfigError(f"config.reward.model={w.model!r}: {e}") from None
    for path in paths:
      try:
        archs = architectures(path)
      except (OSError, ValueError) as e:
        raise ConfigError(f"config.reward.model={path!r}: cannot read its config.json ({e})") from None
      if not any(a.endswith("ForSequenceClassification") for a in archs):
        raise ConfigError(f"config.reward.model={path!r}: architectures {archs} is not a *ForSequenceClassification "
                          "reward model (nor a reward-model ensemble directory with reward_ensemble.json)")
  try:
    reward_spec(cfg)
  except RewardError as e:
    raise ConfigError(f"config.reward: {e}") from None


def _validate_grpo(cfg: RunConfig) -> None:
  g, s = cfg.grpo, cfg.sampling
  if not g.prompts and not g.buffer:
    raise ConfigError("config.grpo.prompts: empty; give a prompt file/glob, tfds:... or synthetic:TASK:SPLIT "
                      "(or grpo.buffer for offline training)")
  if s.num_samples < 2 and g.adv_estimator in ("grpo", "rloo"):
    raise ConfigError(f"config.sampling.num_samples={s.num_samples}: {g.adv_estimator} compares completions of "
                      "the same prompt and needs at least 2")
  rows = g.prompts_per_step * s.num_samples
  if g.mini_batches <= 0 or rows % g.mini_batches:
    raise ConfigError(f"config.grpo.mini_batches={g.mini_batches} does not divide the {rows} completions per step "
                      f"(grpo.prompts_per_step x sampling.num_samples)")
  if g.clip_low < 0 or g.clip_high < g.clip_low:
    raise ConfigError(f"config.grpo.clip_high={g.clip_high} must be >= clip_low={g.clip_low} >= 0")
  if g.clip_c is not None and g.clip_c <= 1.0:
    raise ConfigError(f"config.grpo.clip_c={g.clip_c}: the dual-clip bound must be > 1")
  if g.tau_pos <= 0 or g.tau_neg <= 0:
    raise ConfigError(f"config.grpo.tau_pos={g.tau_pos}, tau_neg={g.tau_neg}: sapo's gate temperatures must be > 0")
  if g.loss_scale_factor < 0:
    raise ConfigError(f"config.grpo.loss_scale_factor={g.loss_scale_factor}: seq-mean-token-sum-norm's constant "
                      "length must be >= 0 (0 = sampling.max_new_tokens)")
  if s.temperature == 0:
    raise ConfigError("config.sampling.temperature=0: GRPO needs sampled (not greedy) completions")
  if cfg.task == "ppo" and g.adv_estimator != "gae":
    raise ConfigError(f"config.grpo.adv_estimator={g.adv_estimator!r}: task 'ppo' trains a critic for GAE; set "
                      "'gae' (or use task 'grpo' for critic-free estimators)")
  if g.kl_ctrl == "adaptive" and not g.kl_in_reward:
    raise ConfigError("config.grpo.kl_ctrl='adaptive' steers the KL subtracted from the reward; set "
                      "grpo.kl_in_reward=True (or kl_ctrl='fixed')")
  if g.kl_target <= 0 or g.kl_horizon <= 0:
    raise ConfigError(f"config.grpo.kl_target={g.kl_target} and kl_horizon={g.kl_horizon} must be positive")
  if not 0 <= g.gamma <= 1 or not 0 <= g.lam <= 1:
    raise ConfigError(f"config.grpo.gamma={g.gamma} and lam={g.lam} must be in [0, 1]")
  if not 0 < g.kl_lr_factor < 1:
    raise ConfigError(f"config.grpo.kl_lr_factor={g.kl_lr_factor} must be in (0, 1)")
  if g.value_clip <= 0:
    raise ConfigError(f"config.grpo.value_clip={g.value_clip} must be positive")
  if g.dynamic_sampling and s.num_samples < 2:
    raise ConfigError(f"config.grpo.dynamic_sampling=True drops groups whose rewards are all equal: with "
                      f"sampling.num_samples={s.num_samples} every group would be dropped; set num_samples >= 2 or "
                      "dynamic_sampling=False")
  if g.tis_imp_ratio_cap < 0 or (g.tis_imp_ratio_cap and not g.buffer):
    raise ConfigError(f"config.grpo.tis_imp_ratio_cap={g.tis_imp_ratio_cap}: truncated importance weights need "
                      "behaviour log-probs, which a replay buffer (grpo.buffer) stores; accepted: 0 (off) or a cap "
                      "> 0 (e.g. 2.0) with grpo.buffer set")
  if g.adv_estimator == "remax" and g.buffer:
    raise ConfigError("config.grpo.adv_estimator='remax' samples a greedy baseline response per prompt while "
                      "training; a replay buffer (grpo.buffer) has none: use online training or another estimator")
  if g.compact_sizes:
    unit = g.prompts_per_step // g.compact_sizes if g.compact_sizes > 0 else 0
    if not g.dynamic_sampling or unit < 1 or g.prompts_per_step % g.compact_sizes or unit % g.mini_batches:
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes}: needs grpo.dynamic_sampling=True (it leaves "
                        f"out the groups that dynamic sampling drops) and must divide prompts_per_step="
                        f"{g.prompts_per_step} into units of whole mini-batches (mini_batches={g.mini_batches}); "
                        "0 = off")
    if g.adv_estimator not in GROUP_LOCAL_ESTIMATORS or g.agg not in ("token-mean", "seq-mean-token-sum-norm"):
      raise ConfigError(f"config.grpo.compact_sizes={g.compact_sizes} with adv_estimator={g.adv_estimator!r}, "
                        f"agg={g.agg!r}: leaving groups out keeps the loss unchanged only when each group's "
                        f"advantages depend on that group alone ({', '.join(GROUP_LOCAL_ESTIMATORS)}) and the "
                        "normaliser ignores masked-out rows (token-mean, seq-mean-token-sum-norm); set 0")
  if g.max_gen_batches < 1 or (g.max_gen_batches > 1 and not g.dynamic_sampling):
    raise ConfigError(f"config.grpo.max_gen_batches={g.max_gen_batches}: must be >= 1, and > 1 (refilling) only "
                      "with grpo.dynamic_sampling=True")


def sampling_rules(cfg: RunConfig):
  """Logical-axis rules for generation: None keeps the training layout."""
  from jalign.models.sharding import without_fsdp
  return without_fsdp(cfg.mesh.rules) if cfg.sampling.layout == "no_fsdp" else None


def reward_spec(cfg: RunConfig):
  from jalign.rl.rewards import RewardSpec
  w = cfg.reward
  return RewardSpec(weights=tuple((str(n), float(x)) for n, x in w.weights),
                    overlong_max_length=w.overlong_max_length, overlong_buffer=w.overlong_buffer,
                    length_target=w.length_target, length_weight=w.length_weight)


def as_dict(cfg) -> dict[str, Any]:
  """JSON-friendly dict of a RunConfig (stored in checkpoints)."""
  return dataclasses.asdict(cfg)
