"""The one way tests run jalign's command line in a subprocess, as a user does: `command` builds the argument list
(for tests that signal a running job through `subprocess.Popen`), `run` runs it to the end."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULTY = os.path.join(ROOT, "tests", "train", "faulty_run.py")  # jalign.run with faults injected (see the file)


def command(config: str | None, run_dir=None, *flags, program: str = "jalign.run",
            chain: bool = False) -> list[str]:
  """`python -m PROGRAM --config=configs/CONFIG --config.run_dir=RUN_DIR --config.log.progress=False FLAGS`.
  `config`: a file under configs/ with its size ("sft.py:tiny", "recipes/hh_dpo.py:smoke"), or None; `program`: a
  module, or a script's path (FAULTY); `chain`: the config is a chain of stages (no log section: each stage logs
  without a progress bar where its output is not a terminal)."""
  head = [sys.executable, program] if program.endswith(".py") else [sys.executable, "-m", program]
  if config is not None:
    head.append(f"--config={ROOT}/configs/{config}")
  if run_dir is not None:
    head += [f"--config.run_dir={run_dir}"] + ([] if chain else ["--config.log.progress=False"])
  return head + [str(f) for f in flags]


def run(config: str | None, run_dir=None, *flags, program: str = "jalign.run", chain: bool = False,
        env: dict | None = None, one_device: bool = False, check: bool = False,
        timeout: int = 600) -> subprocess.CompletedProcess:
  """`command`, run from the repository root to its end. `env`: added to the environment; `one_device`: without the
  test session's fake devices (XLA_FLAGS), as a user runs it (8 devices would change the arithmetic's order);
  `check`: a non-zero exit fails the test, showing the output's tail."""
  environ = {k: v for k, v in os.environ.items() if not (one_device and k == "XLA_FLAGS")}
  proc = subprocess.run(command(config, run_dir, *flags, program=program, chain=chain), cwd=ROOT,
                        env={**environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)
  if check and proc.returncode != 0:
    raise AssertionError(f"{' '.join(proc.args[1:])}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
  return proc
