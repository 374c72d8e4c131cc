"""Runs `faulty_run.py` (the command line with an injected SIGKILL) and reads a finished run's exported weights."""
import os

from tests import cli


def run_faulty(config: str, run_dir, *extra, env=None, check=True, timeout=600):
  """`python faulty_run.py --config=configs/<config>.py:tiny --config.run_dir=... *extra` with `env` added."""
  return cli.run(f"{config}.py:tiny", run_dir, *extra, program=cli.FAULTY, env=env, check=check, timeout=timeout)


def hf_weights(run_dir) -> bytes:
  with open(os.path.join(run_dir, "hf", "model.safetensors"), "rb") as f:
    return f.read()
