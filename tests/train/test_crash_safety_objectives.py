"""Crash safety of SFT, DPO and GRPO end to end. A run SIGKILLed five times at random moments (each restart resumed
by rerunning the same command) ends with HF weights bitwise equal to an uninterrupted run and the same per-step
losses (same data and prompts in the same order, same samples, same reference log-probs). A SIGTERM (preemption)
saves, exits with status 143, and the rerun also ends bitwise equal. SFT's fixed kill points (after a save, mid
step, during a save, onto another mesh) are in test_resume.py."""
import json
import os
import random
import signal
import time

import pytest

from tests.train.crash_util import hf_weights, run_faulty

EVAL_OFF = {"sft": "--config.train.eval_examples=0", "dpo": "--config.train.eval_examples=0",
            "grpo": "--config.grpo.eval_examples=0"}
SEED = int(os.environ.get("CRASH_SEED", "0"))  # the kill times are drawn from this; a failure prints them


def _run(task, run_dir, env=None, check=True):
  return run_faulty(task, run_dir, "--config.train.steps=6", "--config.checkpoint.every=2",
                    "--config.log.tensorboard=False", "--config.train.eval_every=0", "--config.train.log_every=1",
                    EVAL_OFF[task], env=env, check=check)


def _losses(run_dir) -> dict[int, dict]:
  """Per step, the last logged value of each deterministic metric (a resumed step is logged again)."""
  keep = ("train/loss", "train/grad_norm", "actor/loss", "actor/pg_loss", "critic/score/mean", "rewards/margins")
  out: dict[int, dict] = {}
  for line in open(os.path.join(run_dir, "metrics.jsonl")):
    row = json.loads(line)
    out.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k in keep})
  return out


@pytest.fixture(scope="module", params=["sft", pytest.param("dpo", marks=pytest.mark.long), "grpo"])  # CI time
def clean(request, tmp_path_factory):
  run_dir = tmp_path_factory.mktemp(f"clean_{request.param}")
  timing = str(run_dir / "train_seconds")
  _run(request.param, str(run_dir / "run"), env={"TIME_FILE": timing})
  return request.param, str(run_dir / "run"), float(open(timing).read())


def test_five_random_sigkills_then_resume_is_bitwise_equal(clean, tmp_path):
  task, clean_dir, train_s = clean
  rng = random.Random(f"{SEED}:{task}")
  run_dir = str(tmp_path / "run")
  delays = []
  for _ in range(5):  # each kill lands anywhere from the first batch of this attempt to the end of a whole run
    delay = rng.uniform(0.0, train_s)
    delays.append(round(delay, 2))
    proc = _run(task, run_dir, env={"KILL_AFTER_S": f"{delay:.3f}"}, check=False)
    if proc.returncode == 0:  # the rest of the run was shorter than the delay: it finished first
      break
    assert proc.returncode == -signal.SIGKILL, (delays, proc.stderr[-2000:])
  print(f"{task}: train {train_s:.1f} s, kill delays {delays}")
  if not os.path.exists(os.path.join(run_dir, "hf", "model.safetensors")):
    _run(task, run_dir)
  assert hf_weights(run_dir) == hf_weights(clean_dir), f"kill delays {delays} s (CRASH_SEED={SEED})"
  assert _losses(run_dir) == _losses(clean_dir), f"kill delays {delays} s (CRASH_SEED={SEED})"


def test_sigterm_saves_exits_143_and_the_rerun_is_bitwise_equal(clean, tmp_path):
  task, clean_dir, _ = clean
  run_dir = str(tmp_path / "run")
  started = time.time()
  stopped = _run(task, run_dir, env={"TERM_AT_BATCH": "3"}, check=False)
  assert stopped.returncode == 143, stopped.stdout[-2000:] + stopped.stderr[-2000:]
  assert "SIGTERM: saved step" in stopped.stdout and not os.path.exists(os.path.join(run_dir, "hf"))
  assert time.time() - started < 600
  resumed = _run(task, run_dir)
  assert "resumed from" in resumed.stdout + resumed.stderr
  assert hf_weights(run_dir) == hf_weights(clean_dir)
  assert _losses(run_dir) == _losses(clean_dir)
