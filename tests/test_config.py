"""Config validation: each bad config names the key and what is accepted."""
import os

import pytest

from jalign.config import validate
from jalign.core.errors import ConfigError
from tests.configs_util import ROOT, config_dict, run_config


def test_tiny_sft_config_validates():
  cfg = run_config("sft")
  assert cfg.task == "sft" and cfg.train.steps == 8 and cfg.model.arch.hidden_size == 32


@pytest.mark.parametrize("arg", [None, "tiny"])
@pytest.mark.parametrize("name", sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py")))
def test_every_shipped_config_validates(name, arg):
  """Each configs/*.py, default and tiny, passes validation on one device, as `python -m jalign.run` runs it (a
  config derived from another must override what no longer fits it)."""
  if name in ("pipeline", "agent"):  # chains of stages
    from jalign.tasks import chain as pipeline
    pipeline.stage_configs(config_dict(name, arg), 1)
  else:
    validate(config_dict(name, arg), 1)


@pytest.mark.parametrize("overrides, message", [
    (dict(train__stepz=3), r"config.train.stepz: unknown key; accepted keys of config.train: batch_size, "),
    (dict(train__steps="10"), r"config.train.steps: expected an integer, found str '10'"),
    (dict(train__steps=0), r"config.train.steps=0: must be positive"),
    (dict(optim__schedule="exp"), r"config.optim.schedule: 'exp' is not accepted; accepted: 'cosine', 'linear', "
                                  r"'constant'"),
    (dict(optim__lr=-1.0), r"config.optim.lr=-1.0: must be positive"),
    (dict(data__packing="yes"), r"config.data.packing: expected True or False"),
    (dict(train__batch_size=12, mesh__shape=(1, 8, 1)),
     r"config.train.batch_size=12 is not divisible by data-parallel size \(data x fsdp x expert = 8\) x "
     r"train.micro_batches=1; accepted: multiples of 8"),
    (dict(train__batch_size=8, train__micro_batches=2, mesh__shape=(2, 4, 1)),
     r"accepted: multiples of 16"),
    (dict(mesh__shape=(4, 4, 1)), r"config.mesh.shape=\(4, 4, 1\) needs 16 devices; 8 are available"),
    (dict(mesh__shape=(3, -1, 1)), r"config.mesh.shape=\(3, -1, 1\) needs 3 devices x k; 8 are available"),
    (dict(mesh__shape=(1, 0, 1)), r"config.mesh.shape=\(1, 0, 1\): .*sizes must be positive"),
    (dict(mesh__shape=(1, 8)), r"config.mesh.shape=\(1, 8\): \(data, fsdp, tensor\), \(data, fsdp, tensor, expert\) or "
                               r"\(data, fsdp, tensor, expert, sequence\)"),
    (dict(mesh__shape=(1, 1, 1, 3), train__batch_size=4),
     r"batch_size=4 is not divisible by data-parallel size \(data x fsdp x expert = 3\)"),
    (dict(data__max_length=100), r"config.data.max_length=100 exceeds config.train.seq_len=64"),
    (dict(data__train=""), r"config.data.train: empty"),
    (dict(model__arch__num_heads=3), r"config.model.arch: num_attention_heads=3 is not a multiple of "
                                     r"num_key_value_heads=2"),
    (dict(model__dtype="int8"), r"config.model.dtype: 'int8' is not accepted; accepted: 'float32', 'bfloat16'"),
    (dict(task="dpo2"), r"config.task: 'dpo2' is not accepted; accepted: 'sft'"),
])
def test_bad_config_names_the_key(overrides, message):
  with pytest.raises(ConfigError, match=message):
    run_config("sft", **overrides)


@pytest.mark.parametrize("config, overrides, message, reader", [
    ("sft", dict(kl__coef=0.1), r"config.kl.coef=0.1: the sft task does not read config.kl \(it reads "
     r"model, data, log, distributed, mesh, train, optim, checkpoint, logprobs\)\. Leave it at its default "
     r"\(0.001\)", "grpo"),
    ("dpo", dict(sampling__temperature=0.5), r"config.sampling.temperature=0.5: the dpo task does not read", "grpo"),
    ("rm", dict(logprobs__impl="chunked"), r"config.logprobs.impl='chunked': the rm task does not read", "dpo"),
    ("grpo", dict(train__batch_size=64), r"config.train.batch_size=64: the grpo task does not read "
     r"config.train.batch_size; a step's batch is grpo.prompts_per_step x sampling.num_samples completions", "sft"),
    ("ppo", dict(train__micro_batches=2), r"config.train.micro_batches=2: the ppo task does not read", None),
    ("rollout", dict(optim__lr=1e-3), r"config.optim.lr=0.001: the rollout task does not read config.optim", "sft"),
    ("eval", dict(train__steps=3), r"config.train.steps=3: the eval task does not read config.train", "sft"),
])
def test_a_setting_the_task_does_not_read_is_an_error(config, overrides, message, reader):
  """A value the task would ignore is named with what the task reads, not dropped without a word; the same value
  validates for a task that reads it (`reader`)."""
  with pytest.raises(ConfigError, match=message):
    run_config(config, **overrides)
  if reader:
    run_config(reader, **overrides)


def test_grpo_needs_no_batch_size_dividing_the_mesh():
  """train.batch_size, which GRPO does not read, is not checked against the data-parallel size for it."""
  run_config("grpo", mesh__shape=(1, 8, 1))


def test_unknown_config_arg():
  with pytest.raises(ValueError, match="unknown arg 'huge'; accepted: 'tiny' or none"):
    config_dict("sft", "huge")


def test_defaults_hold_every_key_with_its_default():
  """configs/*.py start from `defaults()`: it holds every section and key of RunConfig at its default, optional
  numbers as typed placeholders a command line can set."""
  import dataclasses

  from jalign.config import RunConfig, defaults
  from jalign.core.sections import to_dataclass
  d = defaults()
  assert to_dataclass(RunConfig, d) == RunConfig()

  def keys(section, prefix="config"):
    for f in dataclasses.fields(section):
      value = getattr(section, f.name)
      yield f"{prefix}.{f.name}"
      if dataclasses.is_dataclass(value):
        yield from keys(value, f"{prefix}.{f.name}")

  def present(node, dotted):
    for part in dotted.split(".")[1:]:
      if part not in node:
        return False
      node = node[part]
    return True
  assert [k for k in keys(RunConfig()) if not present(d, k)] == []
  d.policy_loss.clip_c = 3  # a placeholder takes a value of its type (an int converts to the float it declares)
  assert to_dataclass(RunConfig, d).policy_loss.clip_c == 3.0
  with pytest.raises(AttributeError, match="Did you mean"):
    d.lock()
    d.policy_loss.clip_cc = 3.0


def _bounded_fields(cls, prefix: str = "config"):
  """(dotted key, bounds) of every field of `cls` and its sub-sections that declares bounds."""
  import dataclasses
  import typing
  hints = typing.get_type_hints(cls)
  for f in dataclasses.fields(cls):
    if "bounds" in f.metadata:
      yield f"{prefix}.{f.name}", f.metadata["bounds"]
    elif dataclasses.is_dataclass(hints[f.name]):
      yield from _bounded_fields(hints[f.name], f"{prefix}.{f.name}")


def _violation(bounds):
  gt, ge, lt, le, _ = bounds
  if gt is not None:
    return gt
  if ge is not None:
    return ge - 1
  if lt is not None:
    return lt
  return le + 1 if le is not None else None  # finiteness only


def test_every_declared_bound_is_enforced_with_its_key():
  """Each field that declares bounds (`jalign.core.sections.bounded`) rejects a value just outside them, and NaN where it
  is a number, with an error that names its dotted key."""
  import math

  from jalign.config import RunConfig
  fields = list(_bounded_fields(RunConfig))
  assert len(fields) >= 40, len(fields)
  for key, bounds in fields:
    for bad in (_violation(bounds), math.nan):
      if bad is None:
        continue
      values = config_dict("sft", "tiny")
      node = values
      *parents, leaf = key.split(".")[1:]
      for p in parents:
        node = node[p]
      if bad is math.nan and isinstance(node[leaf], int) and not isinstance(node[leaf], bool):
        continue
      node[leaf] = type(node[leaf])(bad) if node[leaf] is not None else bad
      with pytest.raises(ConfigError, match=rf"^{key}=\S+: must be "):
        validate(values, 8)
