"""Asynchronous GRPO (grpo.async_staleness): each step trains on rollouts of the policy k updates before, the lag and
the sampler/trainer log-prob gap are logged, and a run killed with rollouts in flight resumes bitwise."""
import json
import os
import signal

import numpy as np
import pytest

from jalign.data.prompts import Prompt
from jalign.rl.groups import Groups
from tests.train.crash_util import hf_weights, run_faulty

ASYNC = ("--config.grpo.async_staleness=1", "--config.train.steps=4", "--config.checkpoint.async_save=False")
TIMING = ("timing_s/", "perf/", "time")


def _steps(run_dir):
  rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
  return {r["step"]: r for r in rows if "actor/pg_loss" in r}


def test_async_grpo_lags_by_k_and_resumes_bitwise_with_rollouts_in_flight(tmp_path):
  run_faulty("grpo", tmp_path / "straight", *ASYNC)
  straight = _steps(tmp_path / "straight")
  assert [straight[s]["rollout/policy_lag"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
  # Sampled one update before: the trainer's log-probs of the drawn tokens moved (synchronous: equal to rounding).
  assert straight[1]["rollout/logprob_abs_diff_max"] < 1e-4
  assert all(straight[s]["rollout/logprob_abs_diff_max"] > 1e-3 for s in (2, 3, 4))

  killed = run_faulty("grpo", tmp_path / "resumed", *ASYNC, env={"KILL_AFTER_SAVE": "2"}, check=False)
  assert killed.returncode == -signal.SIGKILL
  host = tmp_path / "resumed" / "checkpoints" / "2" / "host"
  assert host.is_dir()  # step 3's rollout, sampled by the policy after step 1, was checkpointed
  run_faulty("grpo", tmp_path / "resumed", *ASYNC)
  resumed = _steps(tmp_path / "resumed")
  for step in (3, 4):
    for key, value in straight[step].items():
      if not key.startswith(TIMING):
        assert resumed[step][key] == value, (step, key)
  assert hf_weights(tmp_path / "resumed") == hf_weights(tmp_path / "straight")


def test_rollout_mesh_samples_on_devices_set_apart(tmp_path):
  """grpo.rollout_mesh=(1, 1, 1) beside a (1, 4, 1) training mesh: the generation thread samples on the last device,
  from weights copied there at each submission, and draws the same groups as sampling on the training devices (the
  same rows on one device: the scores and lengths are equal; the losses take the behaviour log-probs of the other
  device's rounding)."""
  shape = ("--config.mesh.shape=(1,4,1)", "--config.train.steps=3")
  apart = run_faulty("grpo", tmp_path / "apart", *ASYNC, *shape, "--config.grpo.rollout_mesh=(1,1,1)")
  run_faulty("grpo", tmp_path / "shared", *ASYNC, *shape)
  assert ("sampling on a mesh of its own {'data': 1, 'fsdp': 1, 'expert': 1, 'sequence': 1, 'tensor': 1} over devices 7; "
          "training on devices 0,1,2,3") in apart.stdout
  a, b = _steps(tmp_path / "apart"), _steps(tmp_path / "shared")
  for step in (1, 2, 3):
    for key in ("critic/score/mean", "response_length/mean", "rollout/policy_lag"):
      assert a[step][key] == b[step][key], (step, key)
    for key in ("actor/pg_loss", "actor/kl_loss"):
      np.testing.assert_allclose(a[step][key], b[step][key], rtol=5e-2, atol=1e-4, err_msg=f"{step} {key}")
  assert a[1]["rollout/logprob_abs_diff_max"] < 1e-4  # the same policy on another device


def test_rollout_mesh_takes_each_process_last_devices_and_bad_shapes_name_the_key():
  import jax

  from jalign import parallel
  devices = jax.devices()[:8]
  train, rollout = parallel.split_meshes((1, -1, 1), (2, 1, 1), devices)
  assert [d.id for d in rollout.devices.flat] == [6, 7] and train.shape["fsdp"] == 6
  assert set(rollout.devices.flat).isdisjoint(train.devices.flat)
  for bad, message in (((0, 1, 1), r"positive sizes \(data, fsdp, tensor\[, expert\]\)"),
                       ((1, 1), r"positive sizes \(data, fsdp, tensor\[, expert\]\)"),
                       ((2, 2, 2), "below the 8 devices")):
    with pytest.raises(ValueError, match=r"grpo\.rollout_mesh=.*" + message):
      parallel.split_meshes((1, -1, 1), bad, devices)
  with pytest.raises(ValueError, match=r"mesh.shape=\(1, 8, 1\) does not fit the 6 .* sets 2 of them apart"):
    parallel.split_meshes((1, 8, 1), (2, 1, 1), devices)


def test_groups_round_trip_through_json_exactly():
  rng = np.random.RandomState(0)
  g = Groups(prompts=[Prompt(3, [1, 2], "q", "7", "f:3"), Prompt(5, [4], "r", None, "f:5")], size=2,
             response=rng.randint(0, 9, (4, 3)).astype(np.int32), lengths=np.asarray([1, 3, 2, 3], np.int32),
             scores=rng.rand(4).astype(np.float32), behaviour=np.log(rng.rand(4, 3)).astype(np.float32),
             sampler_logp=np.log(rng.rand(4, 3)).astype(np.float32))
  back = Groups.from_json(json.loads(json.dumps(g.to_json())))
  assert back.prompts == g.prompts and back.size == 2 and back.rm_scores is None
  for name in ("response", "lengths", "scores", "behaviour", "sampler_logp"):
    a, b = getattr(g, name), getattr(back, name)
    assert a.dtype == b.dtype and np.array_equal(a, b), name
