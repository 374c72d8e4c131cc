"""LoRA in training: only adapters get gradients, optimizer state and checkpoint space; the base never moves; the
reference of DPO / GRPO / PPO is the base with adapters off; every objective runs with adapters; resume is exact."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jalign import models
from jalign.core.errors import ConfigError
from jalign.models import lora
from jalign.objectives import sft as sft_objective
from jalign.tasks import dpo as dpo_task
from jalign.tasks import grpo
from jalign.tasks import rm as rm_task
from jalign.tasks import sft as sft_task
from jalign.train import loop
from jalign.train import optimizer as optim_lib
from jalign.train.step import make_step
from tests.configs_util import run_config

QUIET = dict(log__progress=False, log__tensorboard=False)
LORA = dict(model__lora__rank=4, model__lora__alpha=8.0)


def _leaves(tree):
  return [(tuple(str(getattr(k, "key", k)) for k in path), x) for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_only_adapters_train_and_hold_optimizer_state(tmp_path):
  cfg = run_config("sft", run_dir=str(tmp_path), **LORA, **QUIET)
  optimizer, schedule = optim_lib.make(cfg.optim, cfg.train.steps)
  s = loop.setup(cfg, optimizer)
  names = {path[-1] for path, _ in _leaves(s.state.params)}
  dense = ("q", "k", "v", "o", "gate", "up", "down")  # the tiny Llama's linear layers
  assert names == {f"{p}{suffix}" for p in dense for suffix in (lora.SUFFIX_A, lora.SUFFIX_B)}
  adapter_size = sum(x.size for _, x in _leaves(s.state.params))
  opt_size = sum(x.size for _, x in _leaves(s.state.opt_state))
  assert adapter_size * 2 <= opt_size <= adapter_size * 2 + 16  # Adam's two moments of the adapters, a few counters
  base_before = jax.tree.map(np.asarray, s.frozen)

  step = jax.jit(make_step(sft_objective.make_loss_fn(s.graphdef), optimizer, schedule, 1))
  rng = np.random.RandomState(0)
  tokens = rng.randint(3, 200, (8, 16)).astype(np.int32)
  batch = {"tokens": tokens, "segment_ids": np.ones_like(tokens), "positions": np.tile(np.arange(16), (8, 1)),
           "loss_mask": np.ones_like(tokens)}
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  state = s.state
  for _ in range(3):
    state, metrics = step(state, batch, s.frozen)
  assert float(metrics["train/loss"]) > 0
  for (path, before), (_, after) in zip(_leaves(base_before), _leaves(s.frozen)):
    np.testing.assert_array_equal(before, np.asarray(after), err_msg=str(path))  # the base never moves
  b_after = np.asarray(state.params["layers"]["q" + lora.SUFFIX_B])
  assert np.abs(b_after).max() > 0  # B left zero: the adapters learned


def test_sft_lora_checkpoints_hold_only_adapters_and_resume_exactly(tmp_path):
  common = dict(train__steps=4, checkpoint__every=2, checkpoint__async_save=False, data__eval="", **LORA, **QUIET)
  straight = sft_task.run(run_config("sft", run_dir=str(tmp_path / "a"), **common))
  common["checkpoint__export_hf"] = False
  sft_task.run(run_config("sft", run_dir=str(tmp_path / "b"), **{**common, "train__steps": 2}))
  resumed = sft_task.run(run_config("sft", run_dir=str(tmp_path / "b"), **common))
  assert resumed["train/loss"] == straight["train/loss"]
  meta = ocp.StandardCheckpointer().metadata(str(tmp_path / "a" / "checkpoints" / "4" / "state"))
  params = meta.item_metadata.tree["params"]
  names = {path[-1] for path, _ in _leaves(params)}
  assert names and all(n.endswith((lora.SUFFIX_A, lora.SUFFIX_B)) for n in names)
  hf = models.from_pretrained(str(tmp_path / "a" / "hf"))  # merged export: a plain HF checkpoint
  assert getattr(hf.layers, "lora", None) is None


def test_dpo_reference_is_the_base_with_adapters_off(tmp_path):
  """A fresh adapter leaves the policy equal to the base, so the first step's implicit rewards beta * (log pi -
  log pi_ref) are zero; later ones move only because the reference (base, adapters off) stays put while the
  adapters learn."""
  final = dpo_task.run(run_config("dpo", run_dir=str(tmp_path), train__steps=4, train__log_every=1,
                                  optim__lr=5e-3, dpo__eval_prompts="", **LORA, **QUIET))
  first = json.loads(open(tmp_path / "metrics.jsonl").readline())
  assert first["step"] == 1
  assert abs(first["rewards/chosen"]) < 1e-6 and abs(first["rewards/rejected"]) < 1e-6
  assert abs(final["rewards/chosen"]) > 1e-3 and abs(final["rewards/margins"]) > 1e-4


@pytest.mark.parametrize("task", ["grpo", pytest.param("ppo", marks=pytest.mark.long),
                                  pytest.param("rm", marks=pytest.mark.long)])  # CI time
def test_objectives_run_with_adapters(task, tmp_path):
  run_dir = str(tmp_path / task)
  if task == "rm":
    final = rm_task.run(run_config("rm", run_dir=run_dir, train__steps=2, **LORA, **QUIET))
    assert np.isfinite(final["train/loss"])
  else:
    final = grpo.run(run_config(task, run_dir=run_dir, train__steps=2, **LORA, **QUIET))
    assert np.isfinite(final["actor/loss"]) or np.isfinite(final.get("critic/vf_loss", np.nan))
  assert os.path.exists(os.path.join(run_dir, "hf", "config.json"))


@pytest.mark.parametrize("overrides,message", [
    (dict(model__lora__rank=-1), "rank >= 0"),
    (dict(model__lora__rank=4, model__lora__targets=("qkv",)), "model.lora.targets: LoRA target 'qkv'"),
    (dict(model__lora__rank=4, model__lora__dropout=1.0), "0 <= dropout < 1"),
])
def test_bad_lora_configs(overrides, message):
  with pytest.raises(ConfigError, match=message):
    run_config("sft", **overrides)


def test_tr_dpo_with_lora_is_refused():
  with pytest.raises(ConfigError, match="sync_ref_model=True with model.lora.rank"):
    run_config("dpo", dpo__sync_ref_model=True, **LORA)


def test_offloaded_reference_lives_in_host_memory_and_changes_nothing(tmp_path):
  """DPO with model.offload_reference: the reference's arrays sit in pinned host memory (device-resident bytes drop
  by its size) and the run's losses equal the on-device run's."""
  import gc

  seen = {}

  def device_bytes():
    gc.collect()
    return sum(x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device")

  class Spy(dpo_task.DpoTask):
    def start(self, setup):
      super().start(setup)
      seen["kinds"] = {x.sharding.memory_kind for x in jax.tree.leaves(self.reference)}
      seen["device_bytes"] = device_bytes()
      seen["reference_bytes"] = sum(x.nbytes for x in jax.tree.leaves(self.reference))

  runs = {}
  for offload in (False, True):
    cfg = run_config("dpo", run_dir=str(tmp_path / str(offload)), train__steps=3, train__log_every=1,
                     dpo__eval_prompts="", data__eval="", checkpoint__export_hf=False,
                     model__offload_reference=offload, **QUIET)
    final = loop.run(cfg, Spy(cfg))
    runs[offload] = (final["train/loss"], dict(seen))
  (loss_on, on), (loss_off, off) = runs[False], runs[True]
  assert on["kinds"] == {"device"} and off["kinds"] == {"pinned_host"}
  assert on["device_bytes"] - off["device_bytes"] >= 0.9 * on["reference_bytes"]
  assert loss_off == pytest.approx(loss_on, rel=1e-6)


def test_offload_with_lora_is_refused():
  with pytest.raises(ConfigError, match="offload_reference=True with model.lora.rank"):
    run_config("dpo", model__offload_reference=True, **LORA)
