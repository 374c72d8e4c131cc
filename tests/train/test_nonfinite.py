"""Numerical faults: a diverging run (absurd learning rate) is caught in the step. With train.nonfinite='stop' it
exits naming the step, the batch's source records and the last good checkpoint; with 'skip' it never applies a
non-finite update, counts the skipped steps (the count survives a resume) and ends with finite weights (SFT and
GRPO). Also the step itself, in isolation."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from safetensors.numpy import load_file

from jalign.train.step import TrainState, make_step
from tests import cli


def _run(run_dir, *extra):
  return cli.run("sft.py:tiny", run_dir, "--config.train.steps=6", "--config.checkpoint.every=1",
                 "--config.checkpoint.async_save=False", "--config.optim.lr=1e35", "--config.optim.schedule=constant",
                 "--config.train.eval_examples=0", *extra)


def test_divergence_stops_with_the_step_records_and_last_good_checkpoint(tmp_path):
  proc = _run(tmp_path / "r")
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  err = proc.stderr
  record = r"synthetic:arith:train:\d+"
  found = re.search(rf"stopped: step (\d+): non-finite loss or gradient .*the update was not applied\. Records in "
                    rf"the batch: ({record})(, {record})*.*\. Last good checkpoint: (\S+)\.", err)
  assert found, err[-2000:]
  step, checkpoint = int(found.group(1)), found.group(4)
  newest = max(int(d) for d in os.listdir(tmp_path / "r" / "checkpoints") if d.isdigit())
  assert checkpoint == f"{tmp_path / 'r' / 'checkpoints'}/{newest}" and newest <= step
  assert not os.path.exists(tmp_path / "r" / "hf")


def test_divergence_with_skip_counts_and_never_applies_a_nonfinite_update(tmp_path):
  proc = _run(tmp_path / "r", "--config.train.nonfinite=skip", "--config.train.log_every=1")
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "update skipped (1 so far)" in proc.stdout
  rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
  counts = [r["train/skipped_nonfinite"] for r in rows if "train/skipped_nonfinite" in r]
  assert counts[0] == 0 and counts[-1] >= 1 and counts == sorted(counts)
  weights = load_file(str(tmp_path / "r" / "hf" / "model.safetensors"))
  assert all(np.all(np.isfinite(w)) for w in weights.values())
  # The count is part of the checkpoint: two more steps resumed from step 6 carry on from it.
  more = _run(tmp_path / "r", "--config.train.nonfinite=skip", "--config.train.log_every=1", "--config.train.steps=8")
  assert more.returncode == 0 and "resumed from" in more.stdout + more.stderr, more.stderr[-2000:]
  rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
  resumed = [r["train/skipped_nonfinite"] for r in rows if "train/skipped_nonfinite" in r][len(counts):]
  assert len(resumed) == 2 and resumed[0] >= counts[-1] >= 2 and resumed == sorted(resumed), (counts, resumed)


def test_step_keeps_params_and_optimizer_state_on_a_nan_batch():
  params = {"w": jnp.ones((3,))}
  loss_fn = lambda p, b: (jnp.sum(p["w"] * b["x"]), jnp.asarray(1.0), {})  # noqa: E731
  optimizer = optax.adam(0.1)
  state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params), jnp.zeros((), jnp.int32))
  step = jax.jit(make_step(loss_fn, optimizer, lambda s: 0.1, 1))
  good, m = step(state, {"x": jnp.ones((1, 3))})
  assert float(m["train/nonfinite"]) == 0.0 and not np.allclose(good.params["w"], 1.0)
  assert int(good.skipped) == 0 and int(m["train/skipped_nonfinite"]) == 0
  bad, m = step(good, {"x": jnp.asarray([[1.0, np.nan, 1.0]])})
  assert float(m["train/nonfinite"]) == 1.0 and int(bad.skipped) == 1 and int(m["train/skipped_nonfinite"]) == 1
  for a, b in zip(jax.tree.leaves((bad.params, bad.opt_state)), jax.tree.leaves((good.params, good.opt_state))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_grpo_divergence_with_skip_counts_updates_and_keeps_finite_weights(tmp_path):
  proc = cli.run("grpo.py:tiny", tmp_path, "--config.train.steps=3", "--config.optim.lr=1e35",
                 "--config.optim.schedule=constant", "--config.grpo.eval_examples=0", "--config.train.nonfinite=skip",
                 "--config.train.log_every=1", check=True)
  assert "non-finite loss or gradient; update skipped (1 so far)" in proc.stdout
  counts = [json.loads(line).get("train/skipped_nonfinite") for line in open(tmp_path / "metrics.jsonl")]
  counts = [c for c in counts if c is not None]
  assert counts[-1] >= 1 and counts == sorted(counts), counts
  weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
  assert all(np.all(np.isfinite(w)) for w in weights.values())
