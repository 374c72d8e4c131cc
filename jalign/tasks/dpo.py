"""The DPO task: the DPO family on preference pairs against a frozen reference (the initial policy); KTO
(`dpo.loss_type='kto'`) on unpaired prompt/completion/label data or on pairs split into their two completions.

Reference log-probs come, in order of preference: from the data (`ref_chosen_logps` / `ref_rejected_logps` on every
pair of every split); from one offline pass before training (`dpo.precompute_ref_logps`; written next to the run as
`run_dir/ref_logps/<split>.jsonl`, the data plus those columns, reused on resume and usable as data later); or from
a reference forward each step. TR-DPO (`dpo.sync_ref_model`) mixes the policy into the reference every
`ref_model_sync_steps` steps; that reference is checkpointed with the train state.
"""
from __future__ import annotations

import functools
import json
import os

import jax
import numpy as np
from flax import nnx

from jalign import parallel
from jalign.config import RunConfig
from jalign.core import files
from jalign.data import preference
from jalign.data.prompts import encode_prompt
from jalign.data.sources import DataError, JsonlSource, open_source
from jalign.eval.policy import accuracy
from jalign.losses.dpo import REFERENCE_FREE
from jalign.objectives import dpo as objective
from jalign.parallel import distributed
from jalign.parallel.distributed import say
from jalign.rewards.verifiable import NEEDS_GROUND_TRUTH
from jalign.tasks.preference import PreferenceTask
from jalign.train import loop
from jalign.train.task import Setup


class WithRefLogps:
  """A source whose records gain `ref_chosen_logps` / `ref_rejected_logps` from arrays indexed like it."""

  def __init__(self, source, chosen: np.ndarray, rejected: np.ndarray):
    self.source, self.chosen, self.rejected = source, chosen, rejected

  def __len__(self) -> int:
    return len(self.source)

  def where(self, i: int) -> str:
    return self.source.where(i)

  def __getitem__(self, i: int) -> dict:
    record = self.source[i]
    if not np.isfinite(self.chosen[i]):
      return record  # a record the reference pass could not encode: encode() reports it again
    return {**record, "ref_chosen_logps": float(self.chosen[i]), "ref_rejected_logps": float(self.rejected[i])}


class DpoTask(PreferenceTask):
  def __init__(self, cfg: RunConfig):
    super().__init__(cfg)
    p = cfg.dpo
    self.loss_cfg = objective.DpoLossConfig(
        loss_type=p.loss_type, beta=p.beta, label_smoothing=p.label_smoothing, simpo_gamma=p.simpo_gamma,
        cpo_alpha=p.cpo_alpha, discopop_tau=p.discopop_tau, rpo_alpha=p.rpo_alpha,
        desirable_weight=p.desirable_weight, undesirable_weight=p.undesirable_weight, router=self.router_loss())
    self.kto = p.loss_type == "kto"
    if self.kto:
      self.batch_fn = preference.kto_batch(self.buckets)
    elif p.share_prompt:  # prefix sharing (Wang & Hegde 2024): the prompt's forward and backward once per pair
      self.batch_fn = preference.split_pair_batch
    self.reference = None
    self.stored_logps = False   # batches carry reference log-probs: no reference forward per step
    self.initial_accuracy: float | None = None

  def encode(self, record, *, tok, max_length, truncation):
    fn = preference.encode_unpaired if self.kto else preference.encode
    return fn(record, tok, max_length=max_length, truncation=truncation)

  def check(self, spec: str, source) -> None:
    if not self.kto:
      return super().check(spec, source)
    d = self.cfg.data
    good, bad, tally = preference.check_unpaired(source, self.encode_fn(), limit=d.check_records,
                                                 skip_bad_records=d.skip_bad_records)
    say(f"data {spec}: {tally.summary()}")
    if d.pair_checks != "off":
      say(f"KTO data {spec}: {good} desirable and {bad} undesirable examples")

  def make_loss_fn(self, graphdef):
    return objective.make_loss_fn(graphdef, self.loss_cfg, logprobs=self.cfg.logprobs)

  def largest_example(self) -> dict:
    pair = super().largest_example()
    if not self.kto:
      return pair
    half = len(pair["chosen"]) // 2  # KTO: the pair's two completions, desirable and undesirable
    return {"examples": [(pair[k][:half], pair[k][half:], pair[k + "_mask"][half:], label)
                         for k, label in (("chosen", 1.0), ("rejected", 0.0))]}

  def abstract_batch(self, model_cfg=None) -> dict:
    batch = super().abstract_batch()
    if self.kto:  # the reference log-probs of the examples and of their KL sequences, which `prepare` adds
      rows = jax.ShapeDtypeStruct(batch["tokens"].shape[:1], np.float32)
      batch.update(ref_logps=rows, ref_kl_logps=rows)
    return batch

  # Reference ---------------------------------------------------------------------------------------------------
  def start(self, setup: Setup) -> None:
    cfg, p = self.cfg, self.cfg.dpo
    self.graphdef, self.mesh = setup.graphdef, setup.mesh
    sharding = parallel.batch_sharding(setup.mesh)
    logps = functools.partial(objective.sequence_logps, setup.graphdef, logprobs=cfg.logprobs)
    ref_fn = lambda params, batch: tuple(logps(params, batch)[0].T)  # noqa: E731
    alpha = p.ref_model_mixup_alpha
    self._mix = jax.jit(lambda policy, ref: jax.tree.map(lambda a, b: (alpha * a + (1 - alpha) * b).astype(b.dtype),
                                                         policy, ref), donate_argnums=1)
    if p.loss_type not in REFERENCE_FREE:
      self.reference = setup.reference()
      if cfg.model.offload_reference:
        ref_fn = parallel.fetching(ref_fn, self.reference)
    self._ref_fn = jax.jit(ref_fn, out_shardings=(sharding, sharding))
    specs = [s for s in (cfg.data.train, cfg.data.eval) if s]
    super().start(setup)  # checks (and with precompute_ref_logps, the reference pass over) every split
    if self.reference is not None and not self.kto:
      self.stored_logps = p.precompute_ref_logps or all(self.stats[s].has_ref_logps for s in specs)
      if self.stored_logps and not p.sync_ref_model:
        self.reference = None  # not needed again: free its memory
    self._eval_prompts = self._load_eval_prompts(setup)
    if self._eval_prompts:
      self.initial_accuracy = self._accuracy(setup.full(setup.state.params))
      say(f"held-out {self._metric} accuracy of the initial policy: {self.initial_accuracy:.4f}")

  def wrap_source(self, spec: str, source):
    if not self.cfg.dpo.precompute_ref_logps or self.reference is None:
      return source
    out_path = os.path.join(self.cfg.run_dir, "ref_logps", _split_name(spec) + ".jsonl")
    if os.path.exists(out_path):
      stored = JsonlSource(out_path)
      if len(stored) == len(source):
        say(f"reference log-probs for {spec}: reusing {out_path}")
        return stored
    chosen, rejected = self._reference_pass(source)
    if distributed.is_main():  # every process computed them (a collective); one writes
      _write_with_logps(source, chosen, rejected, out_path)
    say(f"reference log-probs for {spec}: {int(np.isfinite(chosen).sum())} pairs -> {out_path}")
    return WithRefLogps(source, chosen, rejected)

  def _reference_pass(self, source) -> tuple[np.ndarray, np.ndarray]:
    encode = self.encode_fn()
    index, examples = [], []
    for i in range(len(source)):
      try:
        examples.append(encode(source[i]))
        index.append(i)
      except DataError:
        continue  # skipped or reported by the pipeline, as in training
    chosen = np.full(len(source), np.nan)
    rejected = np.full(len(source), np.nan)
    if examples:
      outs = self.map_batches(examples, lambda b: self._ref_fn(self.reference, b))
      chosen[index] = np.concatenate([o[0] for o in outs])
      rejected[index] = np.concatenate([o[1] for o in outs])
    return chosen, rejected

  def prepare(self, params, batch: dict) -> dict:
    if self.reference is None or self.stored_logps:
      return batch
    first, second = self._ref_fn(self.reference, batch)
    if self.kto:  # the examples and their mismatched KL sequences
      return {**batch, "ref_logps": first, "ref_kl_logps": second}
    return {**batch, "ref_chosen_logps": first, "ref_rejected_logps": second}

  def after_step(self, step: int, params) -> None:
    p = self.cfg.dpo
    if p.sync_ref_model and step % p.ref_model_sync_steps == 0:
      self.reference = self._mix(params, self.reference)

  def extra_state(self):
    return self.reference if self.cfg.dpo.sync_ref_model else None

  def load_extra_state(self, tree) -> None:
    self.reference = tree

  # Task accuracy -----------------------------------------------------------------------------------------------
  def _load_eval_prompts(self, setup: Setup) -> list:
    p = self.cfg.dpo
    self._metric = next((n for n, _ in self.cfg.reward.spec().weights if n in NEEDS_GROUND_TRUTH), None)
    if not p.eval_prompts or not self._metric:
      return []
    source = open_source(p.eval_prompts, self.cfg.data.fields())
    max_prompt = setup.model_cfg.max_position_embeddings - p.eval_max_new_tokens
    return [encode_prompt(source[i], setup.tok, index=i, where=source.where(i), max_length=max_prompt)
            for i in range(min(len(source), p.eval_examples))]

  def _accuracy(self, params) -> float:
    return accuracy(nnx.merge(self.graphdef, params), self.tok, self._eval_prompts, self._metric,
                    self.cfg.dpo.eval_max_new_tokens)

  def evaluate(self, setup, params) -> dict:
    if not self._eval_prompts:
      return {}
    return {"eval/accuracy": self._accuracy(params), "eval/accuracy_initial": self.initial_accuracy}


def _split_name(spec: str) -> str:
  base = os.path.basename(spec.split(",")[0].split("@")[0]).replace(":", "_").replace("*", "_")
  return os.path.splitext(base)[0] or "data"


def _write_with_logps(source, chosen: np.ndarray, rejected: np.ndarray, path: str) -> None:
  """The data plus reference log-prob columns, written to a temporary name and renamed (never half-written)."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with files.atomic_open(path) as f:
    for i in range(len(source)):
      if not np.isfinite(chosen[i]):
        continue
      f.write(json.dumps({**source[i], "ref_chosen_logps": float(chosen[i]),
                          "ref_rejected_logps": float(rejected[i])}) + "\n")


def task(cfg: RunConfig) -> DpoTask:
  return DpoTask(cfg)


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, task(cfg))
