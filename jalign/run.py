"""`python -m jalign.run --config=configs/<task>.py[:tiny] [--config.key=value ...]`

Parses and validates the config, then runs its task. Each task wires an objective's loss to the shared loop.
"""
from __future__ import annotations

import difflib
import importlib.util
import os
import signal
import sys

if __name__ == "__main__":  # a signal while the libraries below import: one line, no traceback
  def _early_exit(signum, frame):
    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "SIGTERM"
    print(f"{name} before this run finished a step: nothing new to save; exiting with status {128 + signum}",
          file=sys.stderr, flush=True)
    os._exit(128 + signum)
  signal.signal(signal.SIGINT, _early_exit)
  signal.signal(signal.SIGTERM, _early_exit)

import jax
import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

from jalign.config import RunConfig, check_paths, validate
from jalign.core.errors import ConfigError, UserError
from jalign.core.sections import listing, to_dataclass
from jalign.parallel import distributed
from jalign.parallel.distributed import DistributedSection
from jalign.rl.config import MOVED

_CONFIG = config_flags.DEFINE_config_file("config", None, "Task config: configs/<task>.py[:arg]", lock_config=True)
_LIST_KEYS = flags.DEFINE_bool("list_keys", False, "Print every key of --config with its value, type and bounds")

HELP = """usage: python -m jalign.run --config=configs/<task>.py[:arg] [--config.<key>=<value> ...] [--list_keys]

Runs the task of a config file (its `task` key: sft, rm, dpo, grpo, ppo, rollout, eval, or a pipeline of them):
  configs/sft.py, rm.py, dpo.py, grpo.py, ppo.py, agent.py, rollout.py, eval.py, pipeline.py  (the demos; ':tiny' for
  a seconds-long run), configs/recipes/*.py  (any Hugging Face or GGUF model on real data; ':smoke' for a short one)

  --config.<key>=<value>   overrides any key, e.g. --config.train.steps=200 --config.run_dir=runs/mine
  --list_keys              prints every key of the config with its value, type and bounds, then exits:
                           python -m jalign.run --config=configs/grpo.py --list_keys

A run writes run_dir/ (metrics.jsonl, checkpoints/, hf/, report.md) and resumes when rerun. Exit status: 0 done;
2 a problem with the input (one `error:` line; JALIGN_TRACEBACK=1 shows the traceback); 130 Ctrl-C and 143 SIGTERM
(the step saved; rerun to resume)."""


def _user_error(e: UserError):
  """`error: <message>` on stderr and exit status 2, without the traceback (JALIGN_TRACEBACK=1 shows it) or the notes
  libraries add to exceptions they pass on (Grain's)."""
  if os.environ.get("JALIGN_TRACEBACK", "0") not in ("", "0"):
    raise e
  print(f"error: {e}", file=sys.stderr, flush=True)
  distributed.shutdown()
  raise SystemExit(2) from None


def _flag_message(argv: list[str], e: Exception) -> str:
  """What a rejected command line got wrong: the config file's own error, or the --config.key it does not have."""
  text = str(e.args[0]) if isinstance(e, (KeyError, AttributeError)) and e.args else str(e)
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), "")
  if "Error whilst parsing config file" in text:  # ml_collections wraps the file's traceback: keep its last line
    return f"--config={spec}: {text.strip().splitlines()[-1].split(': ', 1)[-1]}"
  try:
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    config = module.get_config(arg) if arg else module.get_config()
  except Exception:  # noqa: BLE001 - the file's own failure is reported by the flag itself
    return text
  for flag in argv[1:]:
    keys = flag[2:].split("=", 1)[0].split(".") if flag.startswith("--config.") else []
    node = config
    for depth, key in enumerate(keys[1:], 1):
      if not isinstance(node, ml_collections.ConfigDict) or key not in node:
        where = ".".join(keys[:depth])
        if where == "config.grpo" and key in MOVED:
          return f"{flag.split('=', 1)[0]}: grpo.{key} moved to --config.{MOVED[key]}"
        accepted = sorted(node.keys()) if isinstance(node, ml_collections.ConfigDict) else []
        close = difflib.get_close_matches(key, accepted, n=1)
        return (f"{flag.split('=', 1)[0]}: {spec} has no key {where}.{key}"
                + (f" (did you mean {where}.{close[0]}?)" if close else "")
                + (f"; keys of {where}: {', '.join(accepted)}" if accepted else f"; {where} is a value"))
      node = node[key]
  return text


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing; a command line it rejects (an unknown or mistyped --config.key, a config file that
  raises) is a user error. `--help` prints HELP and exits 0."""
  if any(a in ("-h", "-?", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
    print(HELP, flush=True)
    raise SystemExit(0)
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # noqa: BLE001 - ml_collections raises KeyError, AttributeError, ValueError, flags.Error
    _user_error(ConfigError(_flag_message(argv, e)))


def _list_keys(values: ml_collections.ConfigDict, is_pipeline: bool) -> None:
  """Every key of the config (overrides applied) with its value, type and bounds."""
  if is_pipeline:  # the pipeline's own keys; each stage's keys are those of its task's config
    flat = lambda d, key: [line for k, v in d.items() for line in (  # noqa: E731
        flat(v, f"{key}.{k}") if isinstance(v, dict) else [f"{key}.{k} = {v!r}"])]
    print("\n".join(flat(values.to_dict(), "config")), flush=True)
    return
  print("\n".join(listing(RunConfig, values)), flush=True)


def main(argv):
  """Runs the config's task. A `UserError` (config, data, checkpoint, tokenizer, prompt, reward) ends it with
  `error: <message>` and exit status 2 (`_user_error`); any other exception keeps its traceback."""
  try:
    _main(argv)
  except UserError as e:
    _user_error(e)


def _main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if logging.get_verbosity() == logging.INFO:  # keep library INFO chatter (orbax) off the console unless -v
    logging.set_verbosity(logging.WARNING)
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/<task>.py is required")
  try:
    is_pipeline = _CONFIG.value.get("task") == "pipeline"
  except OSError as e:  # a config file that does not load: ml_collections reports it on first use
    raise ConfigError(f"--config: the config file does not load: {str(e).strip().splitlines()[-1].strip()}") from e
  if _LIST_KEYS.value:
    _list_keys(_CONFIG.value, is_pipeline)
    return
  from jalign import tasks
  from jalign.tasks import chain
  from jalign.train import preemption, rundir
  from jalign.train.loop import NonFiniteError
  from jalign.train.preemption import Preempted
  try:  # the multi-process runtime first: the device count below is the global one
    section = to_dataclass(DistributedSection, _CONFIG.value.get("distributed", {}), "config.distributed")
    distributed.initialize(section)
    preemption.install()  # from here a signal ends start-up at once, with a line instead of a traceback
    if is_pipeline:
      chain.stage_configs(_CONFIG.value, jax.device_count())  # every stage's config checked before any runs
    else:
      cfg = validate(_CONFIG.value, jax.device_count())
      check_paths(cfg)
  except UserError:
    raise
  except ValueError as e:  # the config's checks (ml_collections' and the sections' own) name the key
    raise ConfigError(str(e)) from e
  run_dir = _CONFIG.value.get("run_dir") if is_pipeline else cfg.run_dir
  try:
    with rundir.claimed(run_dir):
      final = chain.run(_CONFIG.value, jax.device_count()) if is_pipeline else tasks.run(cfg)
      if not is_pipeline and cfg.task not in ("eval", "rollout") and distributed.is_main():
        from jalign.eval import report
        print(f"report: {report.build(cfg.run_dir)}", flush=True)
  except NonFiniteError as e:
    raise SystemExit(f"stopped: {e}") from None
  except Preempted as e:  # a distinct status, so supervisors restart it; the same command resumes
    print(e, flush=True)
    distributed.shutdown()
    raise SystemExit(e.code) from None
  shown = ("eval/", "train/loss", "rollout/", "perf/new", "actor/kl", "critic/score", "rewards/", "ensemble/")
  summary = "  ".join(f"{k}={v:.4f}" for k, v in sorted(final.items()) if k.startswith(shown))
  if distributed.is_main():
    print(f"done: {summary}", flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
