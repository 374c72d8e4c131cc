"""Crash safety of the SFT run: SIGKILL then resume is bitwise equal to an uninterrupted run (data order
included); restore onto another mesh; SIGTERM saves and exits cleanly."""
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from tests import cli
from tests.configs_util import ROOT
from tests.train.crash_util import hf_weights, run_faulty

STEPS = 12


def _run(run_dir, *extra, env=None, check=True):
  return run_faulty("sft", run_dir, f"--config.train.steps={STEPS}", "--config.checkpoint.every=3",
                    "--config.train.eval_examples=0", *extra, env=env, check=check, timeout=300)


def _train_losses(run_dir) -> list[tuple[int, float]]:
  import json
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return sorted({(r["step"], r["train/loss"]) for r in rows if "train/loss" in r})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("clean"))
  _run(run_dir)
  return run_dir


@pytest.mark.parametrize("fault", [{"KILL_AFTER_SAVE": "6"}, {"KILL_AT_BATCH": "8"}, {"KILL_DURING_SAVE": "9"}])
def test_sigkill_then_resume_is_bitwise_equal(uninterrupted, tmp_path, fault):
  run_dir = str(tmp_path / "run")
  killed = _run(run_dir, env=fault, check=False)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
  assert not os.path.exists(os.path.join(run_dir, "hf")), "the killed run must not have finished"
  _run(run_dir)
  assert hf_weights(run_dir) == hf_weights(uninterrupted)
  # Same data in the same order: every logged step's loss is identical to the clean run's.
  clean = dict(_train_losses(uninterrupted))
  for step, loss in _train_losses(run_dir):
    assert loss == clean[step], step


def test_restore_onto_a_different_mesh(uninterrupted, tmp_path):
  run_dir = str(tmp_path / "run")
  killed = _run(run_dir, "--config.mesh.shape=(1,8,1)", env={"KILL_AFTER_SAVE": "6"}, check=False)
  assert killed.returncode == -signal.SIGKILL
  _run(run_dir, "--config.mesh.shape=(2,2,2)")
  from safetensors.numpy import load_file
  a = load_file(os.path.join(run_dir, "hf", "model.safetensors"))
  b = load_file(os.path.join(uninterrupted, "hf", "model.safetensors"))
  for name in b:  # another mesh sums partial products in another order: equal to fp32 rounding
    np.testing.assert_allclose(a[name], b[name], atol=1e-5, err_msg=name)


def test_sigterm_saves_and_exits_143(tmp_path):
  run_dir = str(tmp_path / "run")
  cmd = cli.command("sft.py:tiny", run_dir, "--config.train.steps=100000", "--config.checkpoint.every=0",
                    "--config.train.log_every=1")
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  metrics = os.path.join(run_dir, "metrics.jsonl")
  deadline = time.time() + 120
  while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
    assert proc.poll() is None and time.time() < deadline, proc.stdout.read() if proc.poll() is not None else ""
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 143, out[-3000:]  # 128 + SIGTERM: supervisors restart it; the same command resumes
  assert "SIGTERM: saved step" in out
  step = int(out.split("SIGTERM: saved step ")[1].split()[0])
  assert 0 < step < 100000
  from jalign.train.checkpoint import Checkpointer
  assert Checkpointer(os.path.join(run_dir, "checkpoints"), keep=3).latest_step() == step


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_checkpoint_is_detected_and_passed_over(uninterrupted, tmp_path, damage):
  """A finished run's newest checkpoint (12) loses half a file or has two bytes flipped: rerunning the same command
  reports it, moves it aside, resumes from the one before (9) and ends bitwise equal to the clean run."""
  import shutil
  run_dir = str(tmp_path / "run")
  shutil.copytree(uninterrupted, run_dir)
  shutil.rmtree(os.path.join(run_dir, "hf"))
  newest = os.path.join(run_dir, "checkpoints", str(STEPS))
  data = [os.path.join(root, f) for root, _, files in os.walk(os.path.join(newest, "state")) for f in files
          if os.sep + "d" + os.sep in os.path.join(root, f)]
  target = max(data, key=os.path.getsize)  # a chunk of array data
  raw = bytearray(open(target, "rb").read())
  if damage == "truncate":
    raw = raw[:len(raw) // 2]
  else:
    raw[len(raw) // 2] ^= 0xFF
    raw[len(raw) // 2 + 1] ^= 0xFF
  open(target, "wb").write(bytes(raw))
  proc = _run(run_dir)
  assert f"checkpoint {os.path.join(run_dir, 'checkpoints')}/{STEPS} is damaged" in proc.stderr, proc.stderr[-2000:]
  assert "does not match its checksum" in proc.stderr
  assert os.path.isdir(newest + ".damaged")
  assert hf_weights(run_dir) == hf_weights(uninterrupted)


def test_a_save_slower_than_the_grace_period_exits_143_naming_the_last_complete_checkpoint(tmp_path):
  """SIGTERM at batch 6, then a save that would take 60 s: after checkpoint.preempt_grace_s=2 the process says which
  checkpoint is the newest complete one and exits 143 itself; rerunning resumes from that one (step 4)."""
  run_dir = str(tmp_path / "run")
  started = time.time()
  proc = run_faulty("sft", run_dir, "--config.checkpoint.every=4", "--config.checkpoint.async_save=False",
                    "--config.checkpoint.preempt_grace_s=2", "--config.train.steps=8",
                    env={"TERM_AT_BATCH": "6", "SLOW_SAVE": "6:60"}, check=False)
  assert proc.returncode == 143, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert time.time() - started < 60  # did not wait for the slow save
  newest = os.path.join(run_dir, "checkpoints", "4")
  assert f"checkpoint.preempt_grace_s=2 s ran out before the checkpoint was written; exiting with status 143. " \
         f"The newest complete checkpoint is {newest}" in proc.stderr, proc.stderr[-2000:]
  resumed = run_faulty("sft", run_dir, "--config.checkpoint.every=4", "--config.train.steps=8")
  assert f"resumed from {os.path.join(run_dir, 'checkpoints')}/4" in resumed.stdout + resumed.stderr
