"""The ahead-of-time fit check: FSDP divides the per-device parameter and optimizer bytes by the FSDP size (from
XLA's compiled memory analysis), LoRA shrinks the optimizer state, and a Llama-3-8B-shaped step is compiled for 16
devices without allocating the model."""
import json
import os
import subprocess
import sys

import pytest

from jalign import fit
from tests.configs_util import ROOT, run_config


def _state_bytes(r):
  return r["bytes_per_device"]["params"] + r["bytes_per_device"]["optimizer_state"]


def test_fsdp8_holds_an_eighth_of_params_and_optimizer_state_per_device():
  one = fit.report(run_config("sft", mesh__shape=(1, 1, 1)))
  eight = fit.report(run_config("sft", mesh__shape=(1, 8, 1)))
  # From the compiled step: its arguments are the train state plus one small batch.
  ratio = eight["bytes_per_device"]["arguments"] / one["bytes_per_device"]["arguments"]
  assert 0.125 <= ratio < 0.14, ratio  # 1/8, plus the replicated norm scales and the batch
  assert _state_bytes(eight) / _state_bytes(one) == pytest.approx(0.125, rel=0.05)


def test_lora_optimizer_state_is_a_small_fraction():
  full = fit.report(run_config("dpo", mesh__shape=(1, 8, 1)))
  adapters = fit.report(run_config("dpo", mesh__shape=(1, 8, 1), model__lora__rank=4))
  assert adapters["trainable_params"] < 0.1 * full["trainable_params"]
  assert adapters["bytes_per_device"]["optimizer_state"] < 0.15 * full["bytes_per_device"]["optimizer_state"]
  assert adapters["params_total"] > full["params_total"]  # the base is all still there, frozen


@pytest.mark.parametrize("shape,overrides,budget,grows", [
    ((2, 1, 1, 1, 1), dict(train__seq_len=2048, data__max_length=2048, train__batch_size=2), 0.8, "sequence 1 -> 2"),
    ((1, 1, 1, 1, 8), dict(train__seq_len=1024, data__max_length=1024), 0.3, "train.micro_batches x4"),
], ids=["one-row-per-device-grows-sequence", "rows-to-spare-take-micro-batches"])
def test_advice_names_a_change_whose_compiled_step_fits(shape, overrides, budget, grows):
  """A step over budget: the advised change, compiled, peaks under the budget and near the advice's estimate (XLA's
  buffer assignment against the advice's split of the peak into train state and per-token rest)."""
  r = fit.report(run_config("sft", mesh__shape=shape, **overrides))
  hbm = budget * r["bytes_per_device"]["peak_estimate"]
  a = fit.advice(r, hbm)
  assert grows in a["text"], a
  assert "DOES NOT FIT" in fit.format_report(r, hbm / 2**30) and a["text"] in fit.format_report(r, hbm / 2**30)
  changed = fit.report(run_config("sft", **{"mesh__shape": shape, **overrides,
                                            **{k.replace(".", "__"): v for k, v in a["overrides"].items()}}))
  peak = changed["bytes_per_device"]["peak_estimate"]
  assert peak <= hbm and peak == pytest.approx(a["estimate"], rel=0.3), (peak, a)


def test_llama3_8b_fit_check_on_16_devices_allocates_nothing(tmp_path):
  out = tmp_path / "fit.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-m", "jalign.fit", "--config=configs/grpo.py", "--arch=llama3-8b", "--devices=16",
       "--config.mesh.shape=(1,16,1)", "--config.model.dtype=bfloat16", "--config.model.remat=full",
       "--hbm_gib=95", f"--json={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  stdout = proc.stdout
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r["devices"] == 16 and r["mesh"] == {"data": 1, "fsdp": 16, "expert": 1, "sequence": 1,
                                               "tensor": 1}
  assert r["params_total"] == 8_030_261_248  # Meta-Llama-3-8B's published parameter count
  b = r["bytes_per_device"]
  assert b["params"] == pytest.approx(8_030_261_248 * 2 / 16, rel=0.01)  # bf16, sharded 16 ways
  assert b["optimizer_state"] == pytest.approx(2 * b["params"], rel=0.01)  # Adam's two moments
  assert b["peak_estimate"] > b["params"] + b["optimizer_state"]
  assert "fits in 95 GiB per device" in stdout
  assert r["host_peak_rss_bytes"] < 3 * 2**30  # the 16 GB of weights never existed on the host either


@pytest.mark.parametrize("config,overrides", [
    ("grpo", {}),
    ("ppo", {}),
    pytest.param("grpo", {"grpo__async_staleness": 1, "policy_loss__rollout_is": "token", "sampling__top_k": 5,
                          "grpo__ppo_epochs": 2}, marks=pytest.mark.long),  # CI time
    pytest.param("grpo", {"grpo__prompts_per_step": 1, "grpo__mini_batches": 2, "mesh__shape": (1, 2, 1)},
                 marks=pytest.mark.long),  # CI time
], ids=["grpo", "ppo", "async-corrected", "mini-batch-within-a-group"])
def test_fit_compiles_the_update_the_run_runs(tmp_path, monkeypatch, config, overrides):
  """The fit check's batch has the columns the run's update receives (the log-prob plan: old, behaviour, kept and
  reference log-probs, the critic's returns), the response width the sampler produces, and its loss is the run's
  (group size, corrections, normaliser)."""
  from jalign import tasks
  from jalign.tasks import grpo
  cfg = run_config(config, run_dir=str(tmp_path), train__steps=1, grpo__eval_examples=0, log__tensorboard=False,
                   log__progress=False, **overrides)
  seen = []
  update_fn = grpo.GrpoTask._update_fn

  def recording(self, rows):
    jitted = update_fn(self, rows)
    def update(state, batch):
      seen.append({k: tuple(v.shape) for k, v in batch.columns().items()})
      return jitted(state, batch)
    return update
  monkeypatch.setattr(grpo.GrpoTask, "_update_fn", recording)
  tasks.run(cfg)
  task = tasks.task(cfg)
  abstract = {k: tuple(v.shape) for k, v in task.abstract_batch().columns().items()}
  assert seen and all(set(batch) == set(abstract) for batch in seen), (seen[0], abstract)
  for batch in seen:  # the rows and the response width; prompts are left-padded to at most the fit's width
    assert batch["response"] == abstract["response"], (batch, abstract)
    assert batch["tokens"][1] <= abstract["tokens"][1]
  g = cfg.grpo  # a group shares its prompt only where mini-batches hold whole groups
  shared = g.share_prompts and g.prompts_per_step % g.mini_batches == 0
  assert task.loss_cfg.group_size == (cfg.sampling.num_samples if shared else 0)
  r = fit.report(cfg)
  assert r["batch"] == {k: list(v) for k, v in abstract.items()}
