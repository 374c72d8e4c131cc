"""Two processes on localhost (2 CPU devices each, joined by jax.distributed) against one process on 4 devices: the
same losses and final parameters for SFT, DPO and GRPO, and checkpoints that restore across the two layouts (2
processes -> 1 and 1 -> 2). The 1-process runs use 4 of this test process's 8 fake devices, so the mesh is the same
('fsdp' = 4) in both layouts."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

from jalign.tasks import dpo as dpo_task
from jalign.tasks import grpo
from jalign.tasks import rm as reward_task
from jalign.tasks import sft as sft_task
from tests.configs_util import ROOT, run_config

QUIET = dict(log__progress=False, log__tensorboard=False, checkpoint__async_save=False)
COMMON = {  # per task: unpacked rows (each process reads every other record: the same global batch) and no evals
    "sft": dict(data__packing=False, data__eval="", mesh__shape=(1, 4, 1), train__batch_size=8),
    "dpo": dict(data__eval="", dpo__eval_prompts="", mesh__shape=(1, 4, 1), train__batch_size=8),
    "rm": dict(data__eval="", mesh__shape=(1, 4, 1), train__batch_size=8),
    "grpo": dict(grpo__eval_prompts="", mesh__shape=(1, 4, 1)),
}
RUN = {"sft": sft_task.run, "dpo": dpo_task.run, "rm": reward_task.run, "grpo": grpo.run}


def _flag(key: str, value) -> str:
  if isinstance(value, tuple):
    value = "(" + ",".join(str(v) for v in value) + ")"
  return f"--config.{key.replace('__', '.')}={value}"


def _two_processes(task: str, run_dir: str, **overrides) -> None:
  procs = _start_two(task, run_dir, **overrides)
  try:
    outs = [p.communicate(timeout=600)[0] for p in procs]
  finally:  # a hung pair must not outlive the test
    for p in procs:
      p.kill()
  for i, (p, out) in enumerate(zip(procs, outs)):
    assert p.returncode == 0, f"process {i}:\n{out[-4000:]}"


def _start_two(task: str, run_dir: str, **overrides) -> list[subprocess.Popen]:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process: 2 devices, from the config
  settings = {**QUIET, **COMMON[task], "run_dir": run_dir, **overrides}
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jalign.run", f"--config=configs/{task}.py:tiny",
       *[_flag(k, v) for k, v in settings.items()],
       f"--config.distributed.coordinator_address=127.0.0.1:{port}", "--config.distributed.num_processes=2",
       f"--config.distributed.process_id={i}", "--config.distributed.cpu_devices=2"],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
  return procs


def _one_process(task: str, run_dir: str, **overrides) -> dict:
  return RUN[task](run_config(task, **{**QUIET, **COMMON[task], "run_dir": run_dir, **overrides}))


def _metrics(run_dir) -> dict[int, dict]:
  out = {}
  for line in open(os.path.join(run_dir, "metrics.jsonl")):
    row = json.loads(line)
    out.setdefault(row["step"], {}).update(row)
  return out


def _same_metrics(a, b, keys, steps, rtol=1e-5, atol=1e-6):
  ma, mb = _metrics(a), _metrics(b)
  for step in steps:
    for key in keys:
      np.testing.assert_allclose(mb[step][key], ma[step][key], rtol=rtol, atol=atol, err_msg=f"step {step} {key}")


def _same_weights(a, b, atol=1e-6, outliers=0.0, outlier_atol=0.0):
  """Equal weights within `atol`, except at most a fraction `outliers` of each tensor's entries within
  `outlier_atol`."""
  wa, wb = load_file(os.path.join(a, "hf", "model.safetensors")), load_file(os.path.join(b, "hf", "model.safetensors"))
  assert wa.keys() == wb.keys()
  for name in wa:
    off = np.abs(wb[name] - wa[name]) > atol
    assert off.mean() <= outliers, f"{name}: {off.sum()} of {off.size} entries differ by more than {atol}"
    np.testing.assert_allclose(wb[name], wa[name], atol=max(atol, outlier_atol), err_msg=name)


@pytest.mark.long  # CI time: two processes = one: the DPO case below; another layout: tests/train/test_resume.py
def test_sft_two_processes_equal_one_and_checkpoints_cross_layouts(tmp_path):
  steps = dict(train__steps=4, train__log_every=1, checkpoint__every=2)
  one, two_then_one, one_then_two = (str(tmp_path / n) for n in ("one", "two_then_one", "one_then_two"))
  _one_process("sft", one, **steps)
  # 2 processes train steps 1-2 and save; 1 process restores their checkpoint and trains steps 3-4.
  _two_processes("sft", two_then_one, **{**steps, "train__steps": 2, "checkpoint__export_hf": False})
  _one_process("sft", two_then_one, **steps)
  # 1 process trains steps 1-2 and saves; 2 processes restore it, train steps 3-4 and export.
  _one_process("sft", one_then_two, **{**steps, "train__steps": 2, "checkpoint__export_hf": False})
  _two_processes("sft", one_then_two, **steps)
  keys = ("train/loss", "train/grad_norm")
  _same_metrics(one, two_then_one, keys, steps=(1, 2, 3, 4))
  _same_metrics(one, one_then_two, keys, steps=(1, 2, 3, 4))
  _same_weights(one, two_then_one)
  _same_weights(one, one_then_two)  # written by process 0 after both gathered the sharded weights


@pytest.mark.parametrize("task,keys", [
    ("dpo", ("train/loss", "rewards/margins", "logps/chosen")),
    # CI time: DPO stays in the default run
    pytest.param("rm", ("train/loss", "rewards/chosen", "margin"), marks=pytest.mark.long),
    pytest.param("grpo", ("actor/loss", "actor/kl_loss", "critic/score/mean", "response_length/mean"),
                 marks=pytest.mark.long),
])
def test_preference_and_grpo_two_processes_equal_one(task, keys, tmp_path):
  """GRPO: both processes generate the same rollouts on the global mesh, gather and score them identically."""
  settings = dict(train__steps=2, train__log_every=1)
  _one_process(task, str(tmp_path / "one"), **settings)
  _two_processes(task, str(tmp_path / "two"), **settings)
  # The policy loss (~1e-2) is a mean of O(1) advantage-weighted terms that nearly cancel: its rounding is absolute.
  # And its second mini-batch is scored after an update whose first Adam step moves every entry by +-lr by the sign
  # of its gradient: an entry whose gradient is rounding noise lands 2 x lr apart between the layouts, which moved
  # the step's loss by 1.0e-4 (of 8.8e-3) on one draw; the loss gets that much room, the other keys none.
  loose = tuple(k for k in keys if k == "actor/loss")
  _same_metrics(str(tmp_path / "one"), str(tmp_path / "two"), [k for k in keys if k not in loose], steps=(1, 2),
                rtol=1e-4, atol=1e-5)
  _same_metrics(str(tmp_path / "one"), str(tmp_path / "two"), loose, steps=(1, 2), rtol=1e-4, atol=2e-4)
  # Reductions over 2 x 2 devices round differently from 4 on one process; Adam divides a near-zero gradient entry
  # by its own small magnitude, so such an entry can move by up to lr (1e-4) per step either way: a handful of
  # entries (one in 36,864 of the tied embedding, by 3.006e-5, seen on one machine) may differ by up to 2 x lr.
  _same_weights(str(tmp_path / "one"), str(tmp_path / "two"), atol=3e-5, outliers=1e-3, outlier_atol=2e-4)


@pytest.mark.long  # CI time; SFT and DPO on two processes stay in the default run
def test_async_grpo_on_two_processes_samples_on_a_rollout_mesh(tmp_path):
  """Asynchronous GRPO over two processes: the generation thread samples on devices set apart in each process
  (grpo.rollout_mesh), so its programs and the update's share no device and no collective; the run equals one
  process's with the same meshes. Without a rollout mesh the two threads' programs would meet on the same devices
  in a different order per process (seen: gloo aborting on mismatched collective sizes): a config error instead."""
  settings = dict(train__steps=3, train__log_every=1, grpo__async_staleness=1, mesh__shape=(1, 2, 1),
                  grpo__rollout_mesh=(2, 1, 1))
  _one_process("grpo", str(tmp_path / "one"), **settings)
  _two_processes("grpo", str(tmp_path / "two"), **settings)
  exact = ("critic/score/mean", "response_length/mean", "rollout/policy_lag")
  _same_metrics(str(tmp_path / "one"), str(tmp_path / "two"), exact, steps=(1, 2, 3), rtol=1e-4, atol=1e-5)
  _same_metrics(str(tmp_path / "one"), str(tmp_path / "two"), ("actor/loss",), steps=(1, 2, 3), rtol=1e-4,
                atol=2e-4)  # as in the synchronous comparison above
  procs = _start_two("grpo", str(tmp_path / "shared"), train__steps=2, grpo__async_staleness=1)
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, out in zip(procs, outs):
    assert p.returncode != 0 and "needs sampling on devices of its own: set grpo.rollout_mesh" in out, out[-3000:]


def test_sigterm_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
  """Only process 1 gets the preemption notice; JAX's preemption service tells process 0, both save the same step
  (one checkpoint, written together) and exit 143."""
  run_dir = str(tmp_path / "run")
  procs = _start_two("sft", run_dir, train__steps=100000, train__log_every=1, checkpoint__every=0,
                     checkpoint__export_hf=False)
  metrics, deadline = os.path.join(run_dir, "metrics.jsonl"), time.time() + 300
  while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
    assert all(p.poll() is None for p in procs) and time.time() < deadline, "no step logged"
    time.sleep(0.2)
  procs[1].send_signal(signal.SIGTERM)
  try:
    outs = [p.communicate(timeout=300)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [143, 143], outs[0][-3000:] + outs[1][-3000:]
  step = int(outs[0].split("SIGTERM: saved step ")[1].split()[0])
  assert 0 < step < 100000
  assert sorted(int(d) for d in os.listdir(os.path.join(run_dir, "checkpoints")) if d.isdigit()) == [step]
