"""The train step on 8 fake devices equals one device in every DP / FSDP / TP layout; 4 micro-batches equal one big
batch."""
import functools

import jax
import numpy as np
import pytest

from jalign import parallel
from jalign.data import sft as sft_data
from jalign.objectives import sft
from jalign.train import loop
from jalign.train import optimizer as optim_lib
from jalign.train.step import make_step
from jalign.train.task import data_iterator, global_batch
from tests.configs_util import run_config


def _one_step(mesh_shape, micro_batches=1, batch_size=8):
  cfg = run_config("sft", mesh__shape=mesh_shape, train__micro_batches=micro_batches, train__batch_size=batch_size,
                   data__shuffle=False)
  optimizer, lr = optim_lib.make(cfg.optim, cfg.train.steps)
  s = loop.setup(cfg, optimizer)
  encode = functools.partial(sft_data.encode, tok=s.tok, max_length=cfg.data.max_length)
  it, _, _ = data_iterator(cfg, cfg.data.train, encode, train=True)
  local = next(it)
  step = make_step(sft.make_loss_fn(s.graphdef), optimizer, lr, micro_batches,
                   parallel.batch_sharding(s.mesh, leading_micro_axis=True))
  jitted = jax.jit(step, in_shardings=(s.state_shardings, parallel.batch_sharding(s.mesh)),
                   out_shardings=(s.state_shardings, parallel.replicated(s.mesh)))
  with jax.set_mesh(s.mesh):  # the vocabulary-sharded log-prob path reads the mesh from here
    state, metrics = jitted(s.state, global_batch(local, parallel.batch_sharding(s.mesh)))
  return state, jax.device_get(metrics)


# mesh shape -> distinct shards of the q projection: DP only, FSDP only, FSDP x TP, DP x FSDP, all three; context
# parallelism (tokens over `sequence`, ring attention) beside DP, and beside FSDP x TP: `sequence` shares out the
# weights with `fsdp`.
LAYOUTS = {(8, 1, 1): 1, (1, 8, 1): 8, (1, 4, 2): 8, (2, 4, 1): 4, (2, 2, 2): 4, (2, 1, 1, 1, 4): 4,
           (1, 2, 2, 1, 2): 8}


@pytest.mark.parametrize("mesh_shape", sorted(LAYOUTS))
def test_sharded_step_equals_single_device(mesh_shape):
  ref_state, ref_metrics = _one_step((1, 1, 1))
  state, metrics = _one_step(mesh_shape)
  # Tolerance: the sharded matmuls sum partial products in another order (fp32 rounding, ~1e-7 relative).
  np.testing.assert_allclose(metrics["train/loss"], ref_metrics["train/loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["train/grad_norm"], ref_metrics["train/grad_norm"], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  q = state.params["layers"]["q"]
  assert len({str(s.index) for s in q.addressable_shards}) == LAYOUTS[mesh_shape]


def test_gradient_accumulation_equals_one_big_batch():
  big_state, big = _one_step((1, 8, 1), micro_batches=1, batch_size=32)
  acc_state, acc = _one_step((1, 8, 1), micro_batches=4, batch_size=32)
  np.testing.assert_allclose(acc["train/loss"], big["train/loss"], rtol=1e-6)
  np.testing.assert_allclose(acc["train/weight"], big["train/weight"])
  for a, b in zip(jax.tree.leaves(acc_state.params), jax.tree.leaves(big_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)


def test_schedule_counts_training_steps_when_a_step_makes_several_updates():
  cfg = run_config("grpo", train__steps=20, optim__lr=1e-3, optim__schedule="cosine", optim__warmup_steps=4,
                   optim__min_lr_ratio=0.1)
  _, per_update = optim_lib.make(cfg.optim, 20)
  _, per_step = optim_lib.make(cfg.optim, 20, updates_per_step=3)
  # warmup 0 -> lr over 4 steps, then cosine to 0.1 x lr at step 20 (optax's forms, written out)
  expect = lambda s: 1e-3 * s / 4 if s < 4 else 1e-3 * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (s - 4) / 16)))  # noqa
  for count in range(60):
    np.testing.assert_allclose(per_step(count), expect(count // 3), rtol=1e-5)
  np.testing.assert_allclose(per_update(9), expect(9), rtol=1e-5)
