"""Runs `faulty_run.py` (the command line with an injected SIGKILL) and reads a finished run's exported weights."""
import os
import subprocess
import sys

from tests.configs_util import ROOT


def run_faulty(config: str, run_dir, *extra, env=None, check=True, timeout=600):
  """`python faulty_run.py --config=configs/<config>.py:tiny --config.run_dir=... *extra` with `env` added."""
  cmd = [sys.executable, os.path.join(ROOT, "tests", "train", "faulty_run.py"),
         f"--config={ROOT}/configs/{config}.py:tiny", f"--config.run_dir={run_dir}", "--config.log.progress=False",
         *extra]
  proc = subprocess.run(cmd, env={**os.environ, **(env or {})}, cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
  return proc


def hf_weights(run_dir) -> bytes:
  with open(os.path.join(run_dir, "hf", "model.safetensors"), "rb") as f:
    return f.read()
