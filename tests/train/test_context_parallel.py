"""Context parallelism: tokens split over the mesh's `sequence` axis (ring attention between the shards, zig-zag
order inside the model) give the one-device model's log-probs and gradients, and the one-device run's losses and
gradient norms."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jalign import models
from jalign.kernels.zigzag import balanced_order, to_zigzag
from jalign.tasks import dpo as dpo_task
from tests import hf_reference as ref
from tests.configs_util import ROOT, run_config

PAIRS = os.path.join(ROOT, "jalign", "assets", "arith_prefs", "test.jsonl")
QUIET = dict(log__progress=False, log__tensorboard=False, log__jsonl=True)


def _metrics(run_dir, key):
  return [m[key] for m in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if key in m]


@pytest.mark.long  # CI time: a step over a sequence axis = one device: tests/train/test_step.py; the model: below
def test_dpo_with_the_sequence_split_equals_one_device(tmp_path):
  """Three DPO steps (policy and reference passes both sequence-sharded) on one device, and on 2 data x 4 sequence
  shards: the same losses and gradient norms (fp32: the shards sum in another order)."""
  common = dict(data__train=PAIRS, data__eval="", data__shuffle=False, train__steps=3, train__batch_size=4,
                dpo__eval_prompts="", checkpoint__export_hf=False, checkpoint__every=0, train__log_every=1, **QUIET)
  runs = {}
  for shape in [(1, 1, 1), (2, 1, 1, 1, 4)]:
    runs[shape] = str(tmp_path / "x".join(map(str, shape)))
    dpo_task.run(run_config("dpo", run_dir=runs[shape], mesh__shape=shape, **common))
  one, split = runs[(1, 1, 1)], runs[(2, 1, 1, 1, 4)]
  assert len(_metrics(one, "train/loss")) == 3
  np.testing.assert_allclose(_metrics(split, "train/loss"), _metrics(one, "train/loss"), rtol=1e-5)
  np.testing.assert_allclose(_metrics(split, "train/grad_norm"), _metrics(one, "train/grad_norm"), rtol=1e-4)


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_model_in_zigzag_order_equals_one_device(family, tmp_path, monkeypatch):
  """A decoder's log-probs and their gradient with 32 tokens over 4 sequence shards (zig-zag order inside the model,
  the outputs in the tokens' own order) equal one device's, fp32 1e-5: packed rows, left padding, sliding windows
  (mistral; gemma2 also alternating windows and soft-caps)."""
  lm = models.from_pretrained(ref.save(ref.build(family), tmp_path / family))
  graphdef, params = nnx.split(lm)
  rng = np.random.RandomState(0)
  seg = np.ones((2, 32), np.int32)
  seg[0, :5] = 0
  seg[1, 11:25], seg[1, 25:] = 2, 3
  pos = np.zeros_like(seg)
  for b in range(2):
    for s in set(seg[b].tolist()) - {0}:
      pos[b, seg[b] == s] = np.arange(int((seg[b] == s).sum()))
  ids = jnp.asarray(rng.randint(0, lm.cfg.vocab_size, seg.shape))

  def logps(params):
    logits = nnx.merge(graphdef, params)(ids, segment_ids=jnp.asarray(seg), positions=jnp.asarray(pos))
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), ids[:, 1:, None], -1)[..., 0]
    return picked * (seg[:, 1:] == seg[:, :-1]) * (seg[:, 1:] > 0)

  def run(params):
    value, grad = jax.jit(jax.value_and_grad(lambda p: logps(p).sum()))(params)
    return jax.jit(logps)(params), value, grad

  one = run(params)
  from jalign.models import decoder
  laid_out = []
  monkeypatch.setattr(decoder, "to_zigzag", lambda x, shards, axis=1: laid_out.append(shards) or to_zigzag(
      x, shards, axis))
  mesh = models.make_mesh((2, 1, 1, 1, 4))
  with jax.set_mesh(mesh):
    assert balanced_order(32) and not balanced_order(36)
    split = run(jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  assert laid_out and set(laid_out) == {4}  # the tokens went over the shards in zig-zag order
  np.testing.assert_allclose(np.asarray(split[0]), np.asarray(one[0]), atol=1e-5)
  for a, b in zip(jax.tree.leaves(split[2]), jax.tree.leaves(one[2])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
