"""Hostile and malformed inputs, end to end through the tasks `python -m jalign.run` runs: data files, configs,
tokenizers, chat templates and checkpoints. Every case ends in a clear error (a `UserError`, with a message
naming what and where) or a counted skip; none hangs (a deadline per case) or leaves a
partially written output (no HF export, no half-written files) behind."""
import contextlib
import json
import os
import re
import shutil
import signal

import jax
import numpy as np
import pytest
import safetensors.numpy

import jalign
from jalign import tasks
from jalign.config import READS, UNREAD_KEYS, validate
from jalign.core.errors import UserError
from tests import cli
from tests.configs_util import config_dict

ASSETS = os.path.join(os.path.dirname(jalign.__file__), "assets")
POLICY = os.path.join(ASSETS, "tiny_policy")


@contextlib.contextmanager
def deadline(seconds: int):
  def hung(*_):
    raise TimeoutError(f"no result after {seconds} s")
  previous = signal.signal(signal.SIGALRM, hung)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _jsonl(path, records):
  with open(path, "w", encoding="utf-8") as f:
    for r in records:
      f.write(r if isinstance(r, str) else json.dumps(r))
      f.write("\n")
  return str(path)


def _good_sft(n=40):
  return [{"prompt": f"{i}+{i}=", "completion": f"{2 * i}"} for i in range(n)]


def _good_pairs(n=40):
  return [{"prompt": f"{i}+1=", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(n)]


def _policy_copy(tmp, edit_config=None, edit_tensors=None, drop=()):
  path = tmp / "ckpt"
  shutil.copytree(POLICY, path)
  if edit_config:
    cfg = json.load(open(path / "config.json"))
    edit_config(cfg)
    json.dump(cfg, open(path / "config.json", "w"))
  if edit_tensors:
    tensors = safetensors.numpy.load_file(path / "model.safetensors")
    edit_tensors(tensors)
    safetensors.numpy.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  for name in drop:
    os.remove(path / name)
  return str(path)


def _truncate(path, keep=0.5):
  data = open(path, "rb").read()
  open(path, "wb").write(data[:int(len(data) * keep)])


def _tokenizer_copy(tmp, template=None, corrupt=False, drop=False):
  path = tmp / "tok"
  os.makedirs(path)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(POLICY, name), path / name)
  if template is not None:
    cfg = json.load(open(path / "tokenizer_config.json"))
    cfg["chat_template"] = template
    json.dump(cfg, open(path / "tokenizer_config.json", "w"))
  if corrupt:
    _truncate(path / "tokenizer.json", 0.3)
  if drop:
    os.remove(path / "tokenizer.json")
  return str(path)


def _rename(tensors, old, new):
  tensors[new] = tensors.pop(old)


def _first_weight(tensors):
  return next(k for k in sorted(tensors) if k.endswith("q_proj.weight"))


# (id, config, builder(tmp) -> overrides, expected message regex). Errors unless the id starts with "skip".
CASES = [
    # --- data files (SFT) ---
    ("bad_json", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", [_good_sft(1)[0], "{not json"])),
     r"d\.jsonl:2"),
    ("wrong_type", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", [{"prompt": 3, "completion": "4"}])),
     r"d\.jsonl:1.*prompt"),
    ("missing_keys", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", [{"text_a": "1+1="}])),
     r"d\.jsonl:1"),
    ("non_utf8", "sft", lambda t: dict(data__train=_write_bytes(
        t / "d.jsonl", b'{"prompt": "1+1=", "completion": "\xff\xfe"}\n')), r"d\.jsonl:1.*UTF-8"),
    ("empty_dataset", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", [])), r"d\.jsonl.*empty"),
    ("not_a_record", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", ["[1, 2, 3]"])), r"d\.jsonl:1"),
    ("missing_file", "sft", lambda t: dict(data__train=str(t / "nope.jsonl")), r"nope\.jsonl"),
    ("skip_megabyte_string", "sft", lambda t: dict(data__train=_jsonl(
        t / "d.jsonl", _good_sft() + [{"prompt": "1" * 1_000_000, "completion": "2"}]), data__truncation="drop"),
     "data/skipped_too_long"),
    ("skip_bad_record", "sft", lambda t: dict(data__train=_jsonl(t / "d.jsonl", _good_sft() + [{"prompt": 1}]),
                                              data__skip_bad_records=True), "data/skipped_bad_records"),
    # --- preference data (DPO) ---
    ("pair_missing_rejected", "dpo", lambda t: dict(data__train=_jsonl(
        t / "p.jsonl", _good_pairs(3) + [{"prompt": "1+1=", "chosen": "2"}])), r"p\.jsonl:4.*rejected"),
    ("pair_identical", "dpo", lambda t: dict(data__pair_checks="error", data__train=_jsonl(
        t / "p.jsonl", _good_pairs(3) + [{"prompt": "1+1=", "chosen": "2", "rejected": "2"}])), r"identical"),
    ("pair_bad_margin", "dpo", lambda t: dict(data__train=_jsonl(
        t / "p.jsonl", [{**_good_pairs(1)[0], "margin": "big"}])), r"p\.jsonl:1.*margin"),
    ("pair_prompt_too_long", "dpo", lambda t: dict(data__train=_jsonl(
        t / "p.jsonl", [{"prompt": "1" * 200, "chosen": "2", "rejected": "3"}])), r"p\.jsonl:1.*max_length"),
    # --- configs ---
    ("config_unknown_key", "sft", lambda t: dict(train__stepz=3), r"config\.train\.stepz"),
    ("config_wrong_type", "sft", lambda t: dict(train__steps="ten"), r"config\.train\.steps"),
    ("config_bad_choice", "sft", lambda t: dict(logprobs__impl="fast"), r"config\.logprobs\.impl.*accepted"),
    ("config_mesh_too_big", "sft", lambda t: dict(mesh__shape=(4, 4, 1)), r"needs 16 devices"),
    ("config_bad_reward", "grpo", lambda t: dict(reward__weights=(("no_such_reward", 1.0),)), r"no_such_reward"),
    ("config_output_outside_run_dir", "rollout", lambda t: dict(rollout__output="../../elsewhere"),
     r"rollout\.output='\.\./\.\./elsewhere' resolves outside run_dir"),
    ("config_output_symlink_escape", "rollout", lambda t: dict(rollout__output=_escape_link(t)),
     r"resolves outside run_dir"),
    # --- tokenizers and chat templates ---
    ("tokenizer_missing", "dpo", lambda t: dict(tokenizer=_tokenizer_copy(t, drop=True)), r"tokenizer\.json"),
    ("tokenizer_corrupt", "dpo", lambda t: dict(tokenizer=_tokenizer_copy(t, corrupt=True)), r"tokenizer\.json"),
    ("template_python_internals", "dpo", lambda t: dict(
        tokenizer=_tokenizer_copy(t, template="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
        data__train=_jsonl(t / "p.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}],
                                            "chosen": [{"role": "assistant", "content": "2"}],
                                            "rejected": [{"role": "assistant", "content": "3"}]}] * 40)),
     r"unsafe|not allowed|sandbox"),
    ("tokenizer_larger_than_vocab", "sft", lambda t: dict(model__arch__vocab_size=16), r"more than the model's"),
    # --- checkpoints ---
    ("ckpt_missing_config", "dpo", lambda t: dict(model__path=_policy_copy(t, drop=("config.json",))),
     r"config\.json"),
    ("ckpt_pickle_only", "dpo", lambda t: dict(model__path=_pickle_only(t)), r"safetensors"),
    ("ckpt_wrong_shape", "dpo", lambda t: dict(model__path=_policy_copy(t, edit_tensors=lambda x: x.update(
        {_first_weight(x): np.zeros((3, 3), np.float32)}))), r"q_proj\.weight.*shape"),
    ("ckpt_wrong_dtype", "dpo", lambda t: dict(model__path=_policy_copy(t, edit_tensors=lambda x: x.update(
        {_first_weight(x): x[_first_weight(x)].astype(np.int32)}))), r"q_proj\.weight.*dtype"),
    ("ckpt_missing_tensor", "dpo", lambda t: dict(model__path=_policy_copy(t, edit_tensors=lambda x: x.pop(
        _first_weight(x)))), r"q_proj\.weight"),
    ("ckpt_truncated", "dpo", lambda t: dict(model__path=_truncated_policy(t)), r"model\.safetensors"),
    ("ckpt_remote_code", "dpo", lambda t: dict(model__path=_policy_copy(t, edit_config=lambda c: c.update(
        model_type="my_custom_lm", auto_map={"AutoModelForCausalLM": "modeling_custom.MyLM"}))),
     r"my_custom_lm"),
]


def _write_bytes(path, data: bytes):
  open(path, "wb").write(data)
  return str(path)


def _escape_link(tmp):
  """run_dir/link -> a directory outside the run: writing through it would escape."""
  os.makedirs(tmp / "run", exist_ok=True)
  os.makedirs(tmp / "outside", exist_ok=True)
  os.symlink(tmp / "outside", tmp / "run" / "link")
  return "link/buffer"


def _pickle_only(tmp):
  path = _policy_copy(tmp, drop=("model.safetensors",))
  open(os.path.join(path, "pytorch_model.bin"), "wb").write(b"\x80\x04not a real pickle")
  return path


def _truncated_policy(tmp):
  path = _policy_copy(tmp)
  _truncate(os.path.join(path, "model.safetensors"))
  return path


def test_the_catalogue_has_at_least_25_cases():
  assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, config, build, expected", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(tmp_path, name, config, build, expected):
  run_dir = tmp_path / "run"
  sections = config_dict(config, "tiny")
  task = sections.get("task")  # a chain's stages take no overrides here

  def reads(section, key):
    return section in READS.get(task, sections) and key not in UNREAD_KEYS.get(task, {}).get(section, {})
  overrides = {k: v for k, v in dict(log__progress=False, log__tensorboard=False, train__steps=2,
                                     train__eval_examples=0, checkpoint__async_save=False).items()
               if reads(*k.split("__"))}
  overrides.update(run_dir=str(run_dir), **build(tmp_path))
  values = config_dict(config, "tiny", **overrides)
  with deadline(240):
    if name.startswith("skip"):
      cfg = validate(values, jax.device_count())
      assert tasks.run(cfg)[expected] >= 1
      return
    with pytest.raises(Exception) as info:
      cfg = validate(values, jax.device_count())
      tasks.run(cfg)
  error = info.value
  # A user's error, which `python -m jalign.run` ends with its message and exit status 2 (see the black-box test).
  assert isinstance(error, UserError), f"{type(error).__name__}: {error}"
  assert re.search(expected, str(error), flags=re.DOTALL), str(error)
  assert not os.path.exists(run_dir / "hf")
  for root, _, files in os.walk(tmp_path):
    assert not [f for f in files if f.endswith((".tmp", ".partial"))], (root, files)


# Through the command line: a user's error is `error: <message>` on stderr and exit status 2, with no traceback and
# none of the notes libraries attach (Grain's); JALIGN_TRACEBACK=1 shows the traceback.
CLI_CASES = ["bad_json", "missing_file", "config_unknown_key", "config_wrong_type", "template_python_internals",
             "ckpt_pickle_only", "ckpt_truncated", "ckpt_remote_code"]


def _cli(tmp_path, name, env=None):
  _, config, build, expected = next(c for c in CASES if c[0] == name)
  flags = [f"--config.{k.replace('__', '.')}={v}" for k, v in build(tmp_path).items()]
  return cli.run(f"{config}.py:tiny", tmp_path / "run", "--config.train.steps=2", *flags, env=env, timeout=300), \
      expected


@pytest.mark.parametrize("name", CLI_CASES)
def test_user_errors_end_cleanly_on_the_command_line(tmp_path, name):
  proc, expected = _cli(tmp_path, name)
  assert proc.returncode == 2, proc.stderr[-3000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
  assert len(errors) == 1 and re.search(expected, errors[0]), proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and "grain" not in proc.stderr.lower(), proc.stderr[-3000:]
  assert not os.path.exists(tmp_path / "run" / "hf")


def test_jalign_traceback_shows_the_traceback(tmp_path):
  proc, _ = _cli(tmp_path, "bad_json", env={"JALIGN_TRACEBACK": "1"})
  assert proc.returncode != 0 and "Traceback" in proc.stderr and "DataError" in proc.stderr, proc.stderr[-3000:]
