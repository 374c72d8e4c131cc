"""Context parallelism in whole runs: tokens split over the mesh's `sequence` axis (ring attention between the
shards) give the one-device run's losses and gradient norms."""
import json
import os

import numpy as np

from jalign.tasks import dpo as dpo_task
from tests.configs_util import ROOT, run_config

PAIRS = os.path.join(ROOT, "jalign", "assets", "arith_prefs", "test.jsonl")
QUIET = dict(log__progress=False, log__tensorboard=False, log__jsonl=True)


def _metrics(run_dir, key):
  return [m[key] for m in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl"))) if key in m]


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
