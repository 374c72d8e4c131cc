"""Reward-model and DPO tasks end to end: TRL parity of the DPO loss, HF sequence-classification export read by
transformers, precomputed reference log-probs, TR-DPO resume, and bad configs."""
import json
import os
import re

import jax
import numpy as np
import pytest

from jalign.core.errors import ConfigError
from jalign.tasks import dpo as dpo_task
from jalign.tasks import rm as reward_task
from jalign.tokenizers import tokenizer
from tests import cli
from tests.configs_util import ROOT, run_config

ASSETS = os.path.join(ROOT, "jalign", "assets")
PAIRS = [json.loads(line) for line in open(os.path.join(ASSETS, "arith_prefs", "test.jsonl"))][:8]
QUIET = dict(log__progress=False, log__tensorboard=False, log__jsonl=True)


def _data(tmp_path, records=PAIRS):
  path = tmp_path / "pairs.jsonl"
  with open(path, "w") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
  return str(path)


def _metrics(run_dir) -> list[dict]:
  return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def _hf_llama(tmp_path, seed=0):
  """A tiny random HF Llama over the arithmetic tokenizer, saved with that tokenizer."""
  from tests import hf_reference
  model = hf_reference.build("llama", seed=seed, vocab_size=288, max_position_embeddings=64, pad_token_id=0,
                             eos_token_id=2)
  path = str(tmp_path / "hf_llama")
  model.save_pretrained(path)
  tokenizer.load(os.path.join(ASSETS, "arith_tokenizer")).save(path)
  return model, path


def test_dpo_loss_matches_trl_dpo_trainer(tmp_path):
  """Same tiny Llama, same 8 pairs as one batch per step, same AdamW: the per-step losses agree; step 1 is ln 2."""
  import datasets
  import transformers
  from trl import DPOConfig, DPOTrainer

  steps, lr = 4, 1e-3
  _, path = _hf_llama(tmp_path)
  trl_losses = []

  class Recorder(DPOTrainer):
    def compute_loss(self, *args, **kwargs):
      loss = super().compute_loss(*args, **kwargs)
      trl_losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
      return loss

  # bf16=False: TRL's default autocasts to bf16 on CPU; the reference is fp32 like jalign.
  args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=steps, learning_rate=lr,
                   lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, beta=0.1,
                   adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", logging_steps=1,
                   save_strategy="no", report_to=[], use_cpu=True, max_length=64, seed=0, dataloader_num_workers=0,
                   bf16=False)
  ds = datasets.Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in PAIRS])
  tok = transformers.AutoTokenizer.from_pretrained(path)
  policy = transformers.AutoModelForCausalLM.from_pretrained(path)
  reference = transformers.AutoModelForCausalLM.from_pretrained(path)
  Recorder(model=policy, ref_model=reference, args=args, train_dataset=ds, processing_class=tok).train()

  assert len(trl_losses) == steps and trl_losses[0] == pytest.approx(np.log(2), abs=1e-6)
  for share_prompt in (True, False):  # each pair's prompt once (the default), or both whole sequences
    run_dir = str(tmp_path / f"jalign_{share_prompt}")
    cfg = run_config("dpo", model__path=path, data__train=_data(tmp_path), data__eval="", data__max_length=64,
                     train__seq_len=64, train__steps=steps, train__batch_size=8, train__log_every=1, optim__lr=lr,
                     optim__schedule="constant", optim__warmup_steps=0, optim__clip_norm=0.0,
                     optim__weight_decay=0.0, optim__b2=0.999, dpo__eval_prompts="", dpo__rpo_alpha=0.0,
                     dpo__share_prompt=share_prompt, checkpoint__export_hf=False, checkpoint__every=0,
                     run_dir=run_dir, **QUIET)
    dpo_task.run(cfg)
    ours = [m["train/loss"] for m in _metrics(run_dir) if "train/loss" in m]
    assert len(ours) == steps and ours[0] == pytest.approx(np.log(2), abs=1e-6)
    np.testing.assert_allclose(ours, trl_losses, rtol=2e-4, atol=2e-5)
    assert ours[-1] < ours[0] - 2e-3  # the losses moved: the comparison is not of constants


@pytest.mark.parametrize("remat", ["none", "full"])
def test_shared_prompt_logps_equal_whole_sequences(tmp_path, remat):
  """Split-layout log-probs and their gradients equal those of the whole right-padded sequences (remat takes the
  whole rows, the cached prompt path does not run under it)."""
  from flax import nnx

  from jalign import models
  from jalign.data import preference
  from jalign.objectives import dpo as dpo_objective

  _, path = _hf_llama(tmp_path)
  lm = models.from_pretrained(path, remat=remat)
  tok = tokenizer.load(path)
  examples = [preference.encode(r, tok, max_length=64) for r in PAIRS]
  flat = preference.pair_batch((64,))(examples)
  split = preference.split_pair_batch(examples)
  assert split["tokens"].shape[2] < flat["tokens"].shape[2]
  graphdef, params = nnx.split(lm)
  value_grad = jax.jit(jax.value_and_grad(lambda p, b: dpo_objective.sequence_logps(graphdef, p, b)[0].sum()))
  logps = jax.jit(lambda b: dpo_objective.sequence_logps(graphdef, params, b)[0])  # op by op: minutes
  sums = lambda b: np.asarray(logps(b))  # noqa: E731
  np.testing.assert_allclose(sums(split), sums(flat), rtol=1e-5, atol=1e-5)
  (_, g_split), (_, g_flat) = value_grad(params, split), value_grad(params, flat)
  for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_flat)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_reward_model_exports_hf_sequence_classifier(tmp_path):
  """The exported checkpoint loads in transformers as *ForSequenceClassification with the same scores, and loads
  back into jalign with its trained head."""
  import torch
  import transformers

  from jalign.data import preference
  from jalign.objectives.reward import pair_scores

  run_dir = str(tmp_path / "rm")
  cfg = run_config("rm", run_dir=run_dir, data__train=_data(tmp_path), data__eval=_data(tmp_path), train__steps=3,
                   train__eval_examples=8, rm__members=(), **QUIET)
  final = reward_task.run(cfg)
  assert {"eval/pairwise_accuracy", "eval/spearman", "eval/kendall"} <= set(final)
  hf_dir = os.path.join(run_dir, "hf")
  config = json.load(open(os.path.join(hf_dir, "config.json")))
  assert config["architectures"] == ["LlamaForSequenceClassification"]

  tok = tokenizer.load(hf_dir)
  examples = [preference.encode(r, tok, max_length=32) for r in PAIRS]
  batch = preference.pair_batch((32,))(examples)
  ids = torch.tensor(batch["tokens"].reshape(16, 32), dtype=torch.long)
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
  with torch.no_grad():
    theirs = hf(input_ids=ids, attention_mask=torch.tensor(batch["segment_ids"].reshape(16, 32))).logits[:, 0]

  reloaded = run_config("rm", model__path=hf_dir, run_dir=str(tmp_path / "again"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  rm = reward_task.load_reward_model(reloaded, mesh)
  # whole right-padded rows, and each pair's prompt run once (the split layout training uses by default)
  for layout in (batch, preference.split_pair_batch(examples)):
    ours = np.asarray(pair_scores(rm, {k: jax.numpy.asarray(v) for k, v in layout.items()})).reshape(16)
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-4)
  assert np.std(ours) > 1e-3  # a trained, non-constant head


def _hf_pair_scores(model_dir: str, records: list[dict]) -> np.ndarray:
  """[N, 2] scores (chosen, rejected) of `records` by transformers' sequence classifier at `model_dir`."""
  import torch
  import transformers

  from jalign.data import preference
  tok = tokenizer.load(model_dir)
  batch = preference.pair_batch((32,))([preference.encode(r, tok, max_length=32) for r in records])
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
  n = len(records)
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(batch["tokens"].reshape(2 * n, 32), dtype=torch.long),
             attention_mask=torch.tensor(batch["segment_ids"].reshape(2 * n, 32))).logits[:, 0]
  return out.numpy().reshape(n, 2)


def test_reward_model_ensemble_scores_are_the_weighted_sum_of_its_members(tmp_path):
  """rm.members: each member trains on its own pairs and exports like the run's model; run_dir/ensemble holds both
  with their weights, and its held-out figures are those of the weighted sum of the members' scores read by
  transformers (pairwise accuracy; Spearman and Kendall tau-b by scipy against the gold scores)."""
  from scipy import stats

  run_dir = tmp_path / "rm"
  (tmp_path / "member").mkdir()
  member_pairs = _data(tmp_path / "member", [json.loads(line) for line in open(
      os.path.join(ASSETS, "arith_prefs", "rm_magnitude.jsonl"))][:16])
  cfg = run_config("rm", run_dir=str(run_dir), data__train=_data(tmp_path), data__eval=_data(tmp_path),
                   train__steps=3, train__eval_examples=8,
                   rm__members=({"train": member_pairs, "steps": 2, "weight": 0.5},), **QUIET)
  final = reward_task.run(cfg)
  ensemble = run_dir / "ensemble"
  assert json.loads((ensemble / "reward_ensemble.json").read_text()) == {
      "members": [{"path": "0", "weight": 1.0}, {"path": "1", "weight": 0.5}]}
  assert (ensemble / "0" / "model.safetensors").read_bytes() == (run_dir / "hf" / "model.safetensors").read_bytes()
  member_steps = [m["step"] for m in _metrics(run_dir / "members" / "1") if "train/loss" in m]
  assert member_steps[-1] == 2

  first, second = _hf_pair_scores(str(ensemble / "0"), PAIRS), _hf_pair_scores(str(ensemble / "1"), PAIRS)
  assert np.abs(first - second).max() > 1e-3  # two different models
  total = first + 0.5 * second
  gold = np.array([[r["chosen_score"], r["rejected_score"]] for r in PAIRS])
  assert final["ensemble/pairwise_accuracy"] == pytest.approx(np.mean(total[:, 0] > total[:, 1]))
  assert final["ensemble/spearman"] == pytest.approx(stats.spearmanr(total.ravel(), gold.ravel()).statistic, abs=1e-4)
  assert final["ensemble/kendall"] == pytest.approx(stats.kendalltau(total.ravel(), gold.ravel()).statistic, abs=1e-4)
  assert final["member1/eval/pairwise_accuracy"] == pytest.approx(np.mean(second[:, 0] > second[:, 1]))

  # a rerun finds both members trained: nothing retrains, the same ensemble comes out
  again = reward_task.run(cfg)
  assert again["ensemble/spearman"] == pytest.approx(final["ensemble/spearman"], abs=1e-6)
  assert [m["step"] for m in _metrics(run_dir / "members" / "1") if "train/loss" in m] == member_steps


def test_shared_prompt_reward_gradients_equal_whole_sequences(tmp_path):
  """The reward model's Bradley-Terry gradients on the split layout equal those on whole right-padded rows,
  completions of different lengths included (the score is read at each row's own last token)."""
  from flax import nnx

  from jalign.data import preference
  from jalign.objectives import reward as reward_objective

  _, path = _hf_llama(tmp_path)
  cfg = run_config("rm", model__path=path, run_dir=str(tmp_path / "rm"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
  rm = reward_task.load_reward_model(cfg, mesh)
  tok = tokenizer.load(path)
  records = [dict(r, rejected=[{"role": "assistant", "content": "#### 1234567"}]) if i % 3 == 0 else r
             for i, r in enumerate(PAIRS)]
  examples = [preference.encode(r, tok, max_length=64) for r in records]
  flat = {k: jax.numpy.asarray(v) for k, v in preference.pair_batch((64,))(examples).items()}
  split = {k: jax.numpy.asarray(v) for k, v in preference.split_pair_batch(examples).items()}
  assert split["tokens"].shape[2] < flat["tokens"].shape[2]
  assert len({int(n) for n in np.asarray(split["segment_ids"]).sum(-1).reshape(-1)}) > 1  # ragged completions
  graphdef, params = nnx.split(rm)
  loss_fn = reward_objective.make_loss_fn(graphdef, reward_objective.RewardLossConfig(0.01))
  value_grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(p, b)[0]))
  (l_split, g_split), (l_flat, g_flat) = value_grad(params, split), value_grad(params, flat)
  np.testing.assert_allclose(l_split, l_flat, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_flat)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.abs(b).max()))


def test_precomputed_reference_logps_give_the_same_run(tmp_path):
  common = dict(data__train=_data(tmp_path), data__eval="", train__steps=3, train__batch_size=8, dpo__eval_prompts="",
                checkpoint__export_hf=False, **QUIET)
  online, pre = str(tmp_path / "online"), str(tmp_path / "pre")
  dpo_task.run(run_config("dpo", run_dir=online, **common))
  dpo_task.run(run_config("dpo", run_dir=pre, dpo__precompute_ref_logps=True, **common))
  stored = [json.loads(line) for line in open(os.path.join(pre, "ref_logps", "pairs.jsonl"))]
  assert len(stored) == 8 and all(np.isfinite(r["ref_chosen_logps"]) for r in stored)
  a = [m["train/loss"] for m in _metrics(online) if "train/loss" in m]
  b = [m["train/loss"] for m in _metrics(pre) if "train/loss" in m]
  np.testing.assert_allclose(a, b, rtol=1e-5)


def test_tr_dpo_resume_restores_the_synced_reference(tmp_path):
  common = dict(data__train=_data(tmp_path), data__eval="", train__batch_size=8, dpo__eval_prompts="",
                dpo__sync_ref_model=True, dpo__ref_model_sync_steps=2, dpo__ref_model_mixup_alpha=0.5,
                dpo__rpo_alpha=0.0, optim__lr=1e-3, optim__schedule="constant", optim__warmup_steps=0,
                checkpoint__every=0, train__log_every=1, **QUIET)
  clean, split = str(tmp_path / "clean"), str(tmp_path / "split")
  dpo_task.run(run_config("dpo", run_dir=clean, train__steps=6, **common))
  dpo_task.run(run_config("dpo", run_dir=split, train__steps=3, **common))
  dpo_task.run(run_config("dpo", run_dir=split, train__steps=6, **common))
  a = {m["step"]: m["train/loss"] for m in _metrics(clean) if "train/loss" in m}
  b = {m["step"]: m["train/loss"] for m in _metrics(split) if "train/loss" in m}
  for step in (4, 5, 6):  # after the resume, only a restored (synced) reference gives the same losses
    assert b[step] == pytest.approx(a[step], rel=1e-6), step


@pytest.mark.parametrize("task, overrides, message", [
    ("dpo", dict(data__packing=True), "config.data.packing=True: dpo batches whole preference pairs"),
    ("dpo", dict(dpo__loss_type="sigmoidd"), "config.dpo.loss_type: 'sigmoidd' is not accepted; accepted: 'sigmoid'"),
    ("dpo", dict(dpo__sync_ref_model=True, dpo__precompute_ref_logps=True), "go stale"),
    ("dpo", dict(dpo__loss_type="exo_pair"), "exo_pair' needs 0 < label_smoothing < 1"),
    ("dpo", dict(dpo__beta=0.0), "config.dpo.beta=0.0: must be positive"),
    ("rm", dict(rm__head="mlp"), "sequence-classification checkpoint holds one linear score"),
    ("rm", dict(data__max_length=64), "config.data.max_length=64 exceeds config.train.seq_len=32"),
    ("rm", dict(rm__members=({"train": "", "steps": 3},)), "config.rm.members[0].train is empty"),
    ("rm", dict(rm__members=({"train": "p.jsonl", "steps": 0},)), "config.rm.members[0].steps=0: must be positive"),
    ("rm", dict(rm__members=({"train": "p.jsonl", "steps": 3, "weight": float("nan")},)),
     "config.rm.members[0].weight=nan: must be a positive number"),
    ("rm", dict(rm__members=({"train": "p.jsonl", "stepz": 3},)), "config.rm.members[0].stepz: unknown key"),
    ("rm", dict(checkpoint__export_hf=False), "the ensemble is assembled from each member's exported checkpoint"),
])
def test_bad_preference_configs(task, overrides, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    run_config(task, **overrides)


def test_kto_loss_matches_trl_kto_trainer(tmp_path):
  """Unpaired examples (TRL's prompt/completion/label layout), KL sequences from completions cycled by one within
  the batch: jalign's KTO loss equals KTOTrainer's step by step (step 1 = 0.5: policy = reference, KL = 0)."""
  import datasets
  import transformers
  from trl import KTOConfig, KTOTrainer

  steps, lr = 4, 1e-3
  _, path = _hf_llama(tmp_path)
  examples = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
              for r, side in zip(PAIRS, ["chosen", "rejected"] * 4)]
  trl_losses = []

  class Recorder(KTOTrainer):
    def compute_loss(self, *args, **kwargs):
      loss = super().compute_loss(*args, **kwargs)
      trl_losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
      return loss

  args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, max_steps=steps, learning_rate=lr,
                   lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, beta=0.1,
                   adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, optim="adamw_torch", logging_steps=1,
                   save_strategy="no", report_to=[], use_cpu=True, max_length=64, seed=0, dataloader_num_workers=0,
                   bf16=False)
  policy = transformers.AutoModelForCausalLM.from_pretrained(path)
  reference = transformers.AutoModelForCausalLM.from_pretrained(path)
  Recorder(model=policy, ref_model=reference, args=args, train_dataset=datasets.Dataset.from_list(examples),
           processing_class=transformers.AutoTokenizer.from_pretrained(path)).train()

  run_dir = str(tmp_path / "jalign")
  cfg = run_config("dpo", model__path=path, data__train=_data(tmp_path, examples), data__eval="", data__shuffle=False,
                   data__max_length=64, train__seq_len=64, train__steps=steps, train__batch_size=8, train__log_every=1,
                   optim__lr=lr, optim__schedule="constant", optim__warmup_steps=0, optim__clip_norm=0.0,
                   optim__weight_decay=0.0, optim__b2=0.999, dpo__loss_type="kto", dpo__rpo_alpha=0.0,
                   dpo__eval_prompts="", checkpoint__export_hf=False, checkpoint__every=0, run_dir=run_dir, **QUIET)
  dpo_task.run(cfg)
  ours = [m["train/loss"] for m in _metrics(run_dir) if "train/loss" in m]
  assert len(trl_losses) == steps and len(ours) == steps
  assert ours[0] == pytest.approx(0.5, abs=1e-6)
  np.testing.assert_allclose(ours, trl_losses, rtol=2e-4, atol=2e-5)
  assert abs(ours[-1] - ours[0]) > 1e-3


def test_kto_batches_pair_each_prompt_with_another_completion():
  from jalign.data import preference
  tok = tokenizer.load(os.path.join(ASSETS, "arith_tokenizer"))
  records = [preference.encode_unpaired(r, tok, max_length=64) for r in PAIRS[:3]]  # pairs: 2 examples each
  batch = preference.kto_batch((64,))(records)
  assert batch["tokens"].shape == (6, 2, 64)
  np.testing.assert_array_equal(batch["label"], [1, 0, 1, 0, 1, 0])
  rows = [e for r in records for e in r["examples"]]
  for j, (prompt, completion, _, _) in enumerate(rows):
    other = rows[(j - 2) % 6][1]  # the previous pair's completion: never this prompt's own
    kl = batch["tokens"][j, 1]
    np.testing.assert_array_equal(kl[:len(prompt) + len(other)], np.concatenate([prompt, other]))
    np.testing.assert_array_equal(batch["tokens"][j, 0, :len(prompt) + len(completion)],
                                  np.concatenate([prompt, completion]))


@pytest.mark.long  # ~15 minutes alone on 2 AVX2 cores: `python -m pytest -m long`
def test_rm_config_reaches_its_held_out_targets(tmp_path):
  """`python -m jalign.run --config=configs/rm.py` as a user runs it (one CPU device): the two-member ensemble ranks
  the held-out pairs of the policy's own mistakes >= 0.9 pairwise and >= 0.8 Spearman against the gold scores."""
  out = cli.run("rm.py", tmp_path, "--config.log.tensorboard=False", one_device=True, timeout=3600)
  assert out.returncode == 0, out.stderr[-3000:]
  done = [line for line in out.stdout.splitlines() if line.startswith("done: ")][-1]
  final = dict(item.split("=") for item in done.removeprefix("done: ").split())
  print(done)
  assert float(final["ensemble/pairwise_accuracy"]) >= 0.9 and float(final["ensemble/spearman"]) >= 0.8
