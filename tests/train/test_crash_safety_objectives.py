"""Crash safety of DPO and GRPO (SFT's is in test_resume.py): a run SIGKILLed after a checkpoint completed or in the
middle of a step, then rerun with the same command, ends with weights bitwise equal to an uninterrupted run (same
data and prompts in the same order, same samples, same reference log-probs)."""
import os
import signal

import pytest

from tests.train.crash_util import hf_weights, run_faulty


def _run(task, run_dir, env=None, check=True):
  eval_off = "--config.train.eval_examples=0" if task == "dpo" else "--config.grpo.eval_examples=0"
  return run_faulty(task, run_dir, "--config.train.steps=6", "--config.checkpoint.every=2",
                    "--config.log.tensorboard=False", "--config.train.eval_every=0", eval_off, env=env, check=check)


@pytest.fixture(scope="module", params=["dpo", "grpo"])
def clean(request, tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp(f"clean_{request.param}"))
  _run(request.param, run_dir)
  return request.param, run_dir


# GRPO's loop makes two device batches per step; DPO's one: both faults land mid-run, after checkpoint 2.
@pytest.mark.parametrize("fault", [{"KILL_AFTER_SAVE": "4"}, {"KILL_AT_BATCH": "7"}], ids=["after_save", "mid_step"])
def test_sigkill_then_resume_is_bitwise_equal(clean, tmp_path, fault):
  task, clean_dir = clean
  run_dir = str(tmp_path / "run")
  killed = _run(task, run_dir, env=fault, check=False)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert not os.path.exists(os.path.join(run_dir, "hf"))
  resumed = _run(task, run_dir)
  assert "resumed from" in resumed.stdout + resumed.stderr
  assert hf_weights(run_dir) == hf_weights(clean_dir)
