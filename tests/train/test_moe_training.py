"""An MoE policy through the objectives: SFT from scratch (a Mixtral-architecture model on the built-in task), its
HF export loaded by transformers, then GRPO from that export, whose sampler (the decode step over the KV cache runs
the same experts layer) agrees with the trainer's log-probs, DPO and a reward model from it, and an MoE student
distilled; each logs the router's metrics."""
import json

import jax.numpy as jnp
import numpy as np
import transformers

from jalign import models
from jalign.tasks import distill as distill_task
from jalign.tasks import dpo as dpo_task
from jalign.tasks import grpo as grpo_task
from jalign.tasks import rm as rm_task
from jalign.tasks import sft as sft_task
from tests import hf_reference as ref
from tests.configs_util import run_config

QUIET = dict(log__progress=False, log__tensorboard=False)
MOE = dict(model_type="mixtral", num_experts=4, experts_per_token=2, moe_intermediate_size=32, intermediate_size=32,
           norm_topk_prob=True)


def test_moe_sft_from_scratch_then_grpo_from_its_export(tmp_path):
  sft_dir = tmp_path / "sft"
  cfg = run_config("sft", run_dir=str(sft_dir), train__steps=30, optim__warmup_steps=5, **QUIET)
  arch = {**cfg.model.arch.__dict__, **MOE}
  sft_task.run(run_config("sft", run_dir=str(sft_dir), train__steps=30, optim__warmup_steps=5,
                          model__arch=arch, model__router_aux_loss=0.01, model__router_z_loss=0.001, **QUIET))
  rows = [json.loads(line) for line in open(sft_dir / "metrics.jsonl") if "train/loss" in line]
  assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.5, [r["train/loss"] for r in rows]
  for r in rows:  # the router's metrics on every logged step
    assert 0 < r["moe/aux_loss"] <= 4 + 1e-6 and 1.0 <= r["moe/expert_load_max"] <= 2.0 + 1e-6
    assert 0 < r["moe/router_entropy"] <= np.log(4) + 1e-6 and r["moe/z_loss"] > 0
    assert r["moe/routing_mismatch"] == 0.0

  export = str(sft_dir / "hf")
  lm = models.from_pretrained(export, dtype="float32")
  assert lm.cfg.num_experts == 4 and not hasattr(lm.layers, "gate")  # experts only, no dense MLP
  hf = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
  assert type(hf).__name__ == "MixtralForCausalLM"
  ids, mask = ref.batch(lm.cfg.vocab_size)
  assert ref.max_diff(lm(jnp.asarray(ids), jnp.asarray(mask)), ref.hf_logits(hf, ids, mask), mask) <= 1e-4

  grpo_dir = tmp_path / "grpo"
  final = grpo_task.run(run_config("grpo", run_dir=str(grpo_dir), model__path=export, train__steps=2, grpo__no_signal="update",
                                   grpo__dynamic_sampling=False, train__log_every=1, **QUIET))
  assert np.isfinite(final["actor/pg_loss"])
  rows = [json.loads(line) for line in open(grpo_dir / "metrics.jsonl")]
  gaps = [r["rollout/logprob_abs_diff_max"] for r in rows if "rollout/logprob_abs_diff_max" in r]
  assert gaps and max(gaps) < 1e-4, gaps  # fp32: the sampler's routing and log-probs are the trainer's
  assert all(0 < r["moe/router_entropy"] <= np.log(4) + 1e-6 for r in rows if "actor/pg_loss" in r)

  dpo_dir = tmp_path / "dpo"  # DPO from the same export: the checkpoint's load balancing (none) plus a z-loss
  dpo_task.run(run_config("dpo", run_dir=str(dpo_dir), model__path=export, train__steps=2, train__log_every=1,
                          model__router_z_loss=0.001, **QUIET))
  rows = [json.loads(line) for line in open(dpo_dir / "metrics.jsonl") if "train/loss" in line]
  assert rows and all(r["moe/z_loss"] > 0 and 1.0 <= r["moe/expert_load_max"] <= 2.0 + 1e-6 for r in rows)

  # A reward model on the MoE backbone (each pair's prompt shared) and an MoE student distilled from the shipped
  # tiny policy train with their router terms too.
  rm_dir = tmp_path / "rm"
  rm_task.run(run_config("rm", run_dir=str(rm_dir), model__path=export, train__steps=2, train__log_every=1,
                         model__router_aux_loss=0.01, rm__members=(), checkpoint__export_hf=False, **QUIET))
  distill_dir = tmp_path / "distill"
  distill_cfg = run_config("distill", "tiny,offline", run_dir=str(distill_dir), train__steps=2, train__log_every=1,
                           **QUIET)
  distill_task.run(run_config("distill", "tiny,offline", run_dir=str(distill_dir), train__steps=2,
                              train__log_every=1, model__arch={**distill_cfg.model.arch.__dict__, **MOE},
                              model__router_z_loss=0.001, **QUIET))
  for run in (rm_dir, distill_dir):
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if "train/loss" in line]
    assert rows and all(r["moe/aux_loss"] > 0 and 1.0 <= r["moe/expert_load_max"] <= 2.0 + 1e-6 for r in rows), run
    assert all(0 < r["moe/router_entropy"] <= np.log(4) + 1e-6 for r in rows)
  assert all(r["moe/z_loss"] > 0 for r in rows)
