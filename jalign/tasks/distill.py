"""The distillation task: a frozen teacher (any HF or GGUF checkpoint sharing the student's tokenizer) distilled into
the student that trains, in one of three modes (`objectives.distill`):

- `offline` and `gkd`: the SFT data path (packed or bucketed rows of data.train); the teacher runs beside the student
  inside the jitted step, on the same mesh in its own dtype, forward only (it is the step's frozen argument, never
  differentiated or donated). GKD first replaces a batch's completions by the student's own samples, for a fraction
  `distill.lmbda` of the steps (drawn from the seed and the step, so a resumed run draws the same).
- `on_policy`: the GRPO learner (`tasks.grpo`) with the teacher as its reference: the student samples each step, the
  teacher scores every sampled token, the advantages are the per-token reverse KL (`losses.distill`).

Before anything runs, the two tokenizers are compared id by id (`tokenizers.shared_vocabulary`): a teacher with
another vocabulary is an error naming both; padded embedding rows past the shared ids are left out of the divergence.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models
from jalign.config import RunConfig, on_policy_config
from jalign.core.errors import ConfigError
from jalign.data import pipeline
from jalign.data.prompts import Prompt
from jalign.eval.policy import accuracy
from jalign.losses import advantages as adv_lib
from jalign.losses import distill as distill_lib
from jalign.models import lora
from jalign.objectives import distill as objective
from jalign.objectives import grpo as grpo_objective
from jalign.objectives.sft import exact_match
from jalign.rl import rollout as rollout_lib
from jalign.rl.batch import RolloutBatch
from jalign.rl.groups import Groups
from jalign.tasks.grpo import GrpoTask
from jalign.tasks.sft import SftTask
from jalign.tokenizers import tokenizer as tokenizer_lib
from jalign.train import loop
from jalign.train.step import jit_step
from jalign.train.task import Setup, dropout_seed


@dataclasses.dataclass
class Teacher:
  """The frozen teacher on the training mesh: its module split, its parameters placed by the run's rules."""
  graphdef: object
  params: dict
  shardings: dict
  cfg: models.ModelConfig
  vocab: int                # ids the student and the teacher share (both distributions are over these)

  @staticmethod
  def load(cfg: RunConfig, setup: Setup) -> "Teacher":
    d, m = cfg.distill, cfg.model
    dtype = d.teacher_dtype or m.dtype
    lm = models.from_pretrained(d.teacher, dtype=dtype, mesh=setup.mesh, rules=cfg.mesh.rules, compute_dtype=dtype,
                                **m.knobs())
    student_tok = setup.tok
    try:
      teacher_tok = tokenizer_lib.load(d.teacher_tokenizer or d.teacher)
      vocab = tokenizer_lib.shared_vocabulary(student_tok, teacher_tok, student_rows=setup.model_cfg.vocab_size,
                                              teacher_rows=lm.cfg.vocab_size)
    except tokenizer_lib.TokenizerError as e:
      raise ConfigError(f"config.distill.teacher={d.teacher!r}: {e}") from None
    if lm.cfg.final_softcap != setup.model_cfg.final_softcap:
      raise ConfigError(f"config.distill.teacher={d.teacher!r}: its final logit softcap {lm.cfg.final_softcap} is not "
                        f"the student's {setup.model_cfg.final_softcap}; the fused divergence applies one to both")
    graphdef, params = nnx.split(lm)
    shardings = nnx.to_pure_dict(models.state_shardings(lm, setup.mesh, cfg.mesh.rules))
    params = jax.device_put(nnx.to_pure_dict(params), shardings)
    return Teacher(graphdef, params, shardings, lm.cfg, vocab)

  def module(self):
    return nnx.merge(self.graphdef, self.params)


def _with_teacher(params, frozen):
  """The loss's parameters inside the step: (the student's whole dict, the teacher's)."""
  base, teacher = frozen
  return lora.combine(params, base), teacher


class DistillTask(SftTask):
  """Offline KD and GKD on the SFT data path."""

  def start(self, setup: Setup) -> None:
    super().start(setup)
    self.setup = setup
    self.teacher = Teacher.load(self.cfg, setup)
    self.buckets = tuple(sorted(self.cfg.data.buckets)) or (self.cfg.train.seq_len,)
    self.teacher_match = None   # the teacher's held-out exact match (once, at the first evaluation)
    self.sampled_rows = 0.0     # gkd: whether this step's completions are the student's (a metric)

  def make_loss_fn(self, graphdef):
    return objective.make_loss_fn(graphdef, self.teacher.graphdef, self.cfg.distill, vocab=self.teacher.vocab,
                                  logprobs=self.cfg.logprobs)

  def jit_update(self, mesh, t, optimizer, schedule):
    t = dataclasses.replace(t, frozen=(t.frozen, self.teacher.params),
                            frozen_shardings=(t.frozen_shardings, self.teacher.shardings))
    return jit_step(self.make_loss_fn(t.graphdef), optimizer, schedule, self.micro_batches(), mesh, t,
                    dropout_seed=dropout_seed(self.cfg), combine=_with_teacher)

  def step_frozen(self):
    return self.setup.frozen, self.teacher.params

  def loss_params(self, params):
    return params, self.teacher.params

  def train_step(self, state, step: int):
    state, out = super().train_step(state, step)
    if self.cfg.distill.mode == "gkd":
      out.metrics["distill/student_samples"] = self.sampled_rows
    return state, out

  # GKD: the student's completions ------------------------------------------------------------------------------
  def next_batch(self, state, step: int) -> dict:
    local = next(self.iterator)
    d = self.cfg.distill
    self.sampled_rows = 0.0
    if d.mode != "gkd" or np.random.default_rng([self.cfg.seed, step]).random() >= d.lmbda:
      return local
    self.sampled_rows = 1.0
    return self.student_rows(local, self.setup.full(state.params), jax.random.fold_in(jax.random.key(self.cfg.seed),
                                                                                      step))

  def student_rows(self, local: dict, params, key) -> dict:
    """The batch `local` (bucketed rows, one example each) with every row's completion replaced by one the student
    samples from its prompt (the tokens before its first loss token), cut to fit train.seq_len; a row without a
    prompt keeps its own."""
    cfg, s = self.cfg, self.cfg.sampling
    tokens, loss_mask, seg = local["tokens"], local["loss_mask"], local["segment_ids"]
    starts = [int(np.argmax(m != 0)) if m.any() else int((g != 0).sum()) for m, g in zip(loss_mask, seg)]
    rows = [i for i, p in enumerate(starts) if p > 0]
    prompts = [Prompt(i, tokens[i, :starts[i]].tolist(), "", None, "") for i in rows]
    sampled = rollout_lib.sample(nnx.merge(self.setup.graphdef, params), self.tok, prompts, key,
                                 dataclasses.replace(s, num_samples=1), mesh=self.setup.mesh,
                                 rules=s.rules(cfg.mesh.rules))
    examples = []
    for i in range(len(tokens)):
      n = int((seg[i] != 0).sum())
      ids, mask = tokens[i, :n], loss_mask[i, :n]
      if i in rows:
        j = rows.index(i)
        completion = sampled.tokens[j, :sampled.lengths[j]][:cfg.train.seq_len - starts[i]]
        ids = np.concatenate([tokens[i, :starts[i]], completion]).astype(np.int32)
        mask = np.concatenate([np.zeros(starts[i], np.int32), np.ones(len(completion), np.int32)])
      examples.append({"tokens": ids, "loss_mask": mask, "record": np.full(len(ids), local["record"][i].max())})
    return pipeline.bucket_batch(self.buckets)(examples)

  # Evaluation --------------------------------------------------------------------------------------------------
  def evaluate(self, setup, params) -> dict:
    out = super().evaluate(setup, params)
    if out:
      if self.teacher_match is None:
        self.teacher_match = exact_match(self.teacher.graphdef, self.teacher.params, self.eval_examples())
      out["eval/exact_match_teacher"] = self.teacher_match
    return out


class OnPolicyDistillTask(GrpoTask):
  """On-policy distillation: the GRPO learner, the teacher its reference, the reverse KL per token its reward."""

  def __init__(self, cfg: RunConfig):
    super().__init__(on_policy_config(cfg))
    self.distill = cfg.distill

  def make_reference(self, setup: Setup, logprobs_fn):
    self.teacher = Teacher.load(self.cfg, setup)
    t, temperature, opts = self.teacher, self.cfg.sampling.temperature, self.cfg.logprobs
    return t.params, jax.jit(lambda params, batch: grpo_objective.response_logprobs(
        t.graphdef, params, batch, temperature, opts, self.group_size)[0], out_shardings=self.batch_sharding)

  def build(self, setup: Setup, optimizer, schedule):
    iterator = super().build(setup, optimizer, schedule)
    self.teacher_accuracy = {}
    if self.eval_prompts:  # before a resume restores the state: the student as loaded, and the teacher
      self.initial = self._accuracies(self._policy(setup.full(setup.state.params)))
      self.teacher_accuracy = {"eval/accuracy_teacher": accuracy(
          self.teacher.module(), setup.tok, self.eval_prompts, self.metric, self.cfg.sampling.max_new_tokens)}
    return iterator

  def begin(self, state, start: int) -> None:
    self.step = start
    if self.initial:
      self.say(f"held-out {self.metric} accuracy of the student {self.initial['eval/accuracy']:.4f}, of the "
               f"teacher {self.teacher_accuracy['eval/accuracy_teacher']:.4f}")
      self.log.write(start, {**self.initial, **self.teacher_accuracy})
      self.monitors.after_eval(start, self.initial["eval/accuracy"], len(self.eval_prompts))

  def advantages(self, batch: RolloutBatch, trained: Groups, kl_coef: float):
    """Per-token rewards -coef (log pi_student - log pi_teacher) of the sampled tokens (the student's log-probs
    before the update, `old_logp`), discount 0; plus reward_weight x GRPO's group advantage of the verifiable
    reward."""
    d, mask = self.distill, batch.response_mask
    outcome = None
    if d.reward_weight:
      ids = jnp.asarray(np.repeat(np.arange(len(trained.prompts)), trained.size))
      outcome = d.reward_weight * adv_lib.grpo(jnp.asarray(trained.scores), ids)[:, None]
    adv = distill_lib.on_policy_advantages(batch.old_logp, batch.ref_logp, mask, coef=d.coef, outcome_BxT=outcome)
    weights = mask.astype(jnp.float32)
    reverse_kl = float(adv_lib.masked_mean(batch.old_logp - batch.ref_logp, weights))
    batch = batch.replace(advantages=jax.device_put(adv, self.batch_sharding))
    metrics = {"actor/reward_kl": reverse_kl, "actor/kl_loss": reverse_kl,
               "critic/advantages/mean": float(adv_lib.masked_mean(adv, weights))}
    return batch, metrics, not bool(jnp.any((adv != 0) & (mask > 0)))

  def evaluate(self, setup, params) -> dict:
    out = super().evaluate(setup, params)
    return {**out, **self.teacher_accuracy} if out else out


def task(cfg: RunConfig):
  return OnPolicyDistillTask(cfg) if cfg.distill.mode == "on_policy" else DistillTask(cfg)


def run(cfg: RunConfig) -> dict:
  return loop.run(cfg, task(cfg))
