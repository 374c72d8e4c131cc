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
from jalign.data.sft import TooLong
from jalign.data.sources import DataError, open_source
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
  """A frozen teacher on a mesh: its module split, its parameters placed by the run's rules."""
  graphdef: object
  params: dict
  shardings: dict
  cfg: models.ModelConfig
  vocab: int                # ids the student and the teacher share (both distributions are over these)

  @staticmethod
  def load(path: str, *, key: str, tokenizer: str, dtype: str, student_tok, student_cfg, mesh, rules,
           knobs: dict) -> "Teacher":
    """The teacher at `path` (config key `key`, named by its errors) beside a student with tokenizer `student_tok`
    and config `student_cfg`: its tokenizer (`tokenizer`, or the teacher's own) compared with the student's id by
    id."""
    lm = models.from_pretrained(path, dtype=dtype, mesh=mesh, rules=rules, compute_dtype=dtype, **knobs)
    try:
      teacher_tok = tokenizer_lib.load(tokenizer or path)
      vocab = tokenizer_lib.shared_vocabulary(student_tok, teacher_tok, student_rows=student_cfg.vocab_size,
                                              teacher_rows=lm.cfg.vocab_size)
    except tokenizer_lib.TokenizerError as e:
      raise ConfigError(f"config.{key}={path!r}: {e}") from None
    if lm.cfg.final_softcap != student_cfg.final_softcap:
      raise ConfigError(f"config.{key}={path!r}: its final logit softcap {lm.cfg.final_softcap} is not the "
                        f"student's {student_cfg.final_softcap}; the divergence applies one to both")
    graphdef, params = nnx.split(lm)
    shardings = nnx.to_pure_dict(models.state_shardings(lm, mesh, rules))
    params = jax.device_put(nnx.to_pure_dict(params), shardings)
    return Teacher(graphdef, params, shardings, lm.cfg, vocab)

  @staticmethod
  def of_run(cfg: RunConfig, setup: Setup) -> "Teacher":
    """`distill.teacher` beside the run's student, on its training mesh."""
    d = cfg.distill
    return Teacher.load(d.teacher, key="distill.teacher", tokenizer=d.teacher_tokenizer,
                        dtype=d.teacher_dtype or cfg.model.dtype, student_tok=setup.tok,
                        student_cfg=setup.model_cfg, mesh=setup.mesh, rules=cfg.mesh.rules, knobs=cfg.model.knobs())

  def module(self):
    return nnx.merge(self.graphdef, self.params)

  def response_topk_fn(self, k: int):
    """jitted (params, batch: RolloutBatch) -> (log-probs, ids) [N, R, k] of the teacher's k likeliest tokens at each
    response position (temperature 1, over the shared vocabulary); a row's [R, V] logits at a time."""
    vocab, cap = self.vocab, self.cfg.final_softcap

    def topk(params, batch):
      lm = nnx.merge(self.graphdef, params)
      hidden = lm.response_hidden(batch.tokens, segment_ids=batch.segment_ids, positions=batch.positions,
                                  response_len=batch.response.shape[1])
      unembed = lm.unembed()[:, :vocab]

      def row(h_RxD):
        z = jnp.dot(h_RxD, unembed.astype(h_RxD.dtype), preferred_element_type=jnp.float32)
        z = z if cap is None else jnp.tanh(z / cap) * cap
        return jax.lax.top_k(jax.nn.log_softmax(z, axis=-1), k)
      return jax.lax.map(row, hidden)
    return jax.jit(topk)

  def response_logprobs_fn(self, temperature: float, logprobs, group_size: int = 0, out_shardings=None):
    """jitted (params, batch: RolloutBatch) -> the teacher's log-probs [N, R] of the response tokens."""
    return jax.jit(lambda params, batch: grpo_objective.response_logprobs(
        self.graphdef, params, batch, temperature, logprobs, group_size)[0], out_shardings=out_shardings)


def _with_teacher(params, frozen):
  """The loss's parameters inside the step: (the student's whole dict, the teacher's)."""
  base, teacher = frozen
  return lora.combine(params, base), teacher


class DistillTask(SftTask):
  """Offline KD and GKD on the SFT data path; offline, without a live teacher, from data with the teacher's
  precomputed top-k (a replay buffer written with rollout.teacher_top_k)."""

  def start(self, setup: Setup) -> None:
    super().start(setup)
    cfg = self.cfg
    self.setup = setup
    self.buckets = tuple(sorted(cfg.data.buckets)) or (cfg.train.seq_len,)
    self.teacher = Teacher.of_run(cfg, setup) if cfg.distill.teacher else None
    self.vocab = self.teacher.vocab if self.teacher else setup.model_cfg.vocab_size
    if self.teacher is None:
      self._check_stored(cfg)
      self.batch_fn = _topk_batch(self.buckets)
    self.teacher_match = None   # the teacher's held-out exact match (once, at the first evaluation)
    self.sampled_rows = 0.0     # gkd: whether this step's completions are the student's (a metric)

  def _check_stored(self, cfg: RunConfig) -> None:
    """Without a teacher, the training data carries its top-k (checked on the first record) and fits the loss."""
    first = open_source(cfg.data.train, cfg.data.fields())[0]
    if first.get("teacher_topk_ids") is None:
      raise ConfigError(f"config.distill.teacher: empty, and config.data.train={cfg.data.train!r} has no "
                        "teacher_topk_ids (a replay buffer written with rollout.teacher_top_k has them); name the "
                        "teacher, or such data")
    if cfg.data.packing:
      raise ConfigError("config.data.packing=True with a teacher's stored top-k: their rows are bucketed, not packed; "
                        "set data.packing=False")
    if cfg.distill.temperature != 1.0:
      raise ConfigError(f"config.distill.temperature={cfg.distill.temperature}: a stored top-k is the teacher's "
                        "distribution at temperature 1; set distill.temperature=1")

  def encode(self, record, *, tok, max_length, truncation):
    if self.teacher is None:
      return _encode_stored(record, max_length)
    return super().encode(record, tok=tok, max_length=max_length, truncation=truncation)

  def make_loss_fn(self, graphdef):
    return objective.make_loss_fn(graphdef, self.teacher and self.teacher.graphdef, self.cfg.distill,
                                  vocab=self.vocab, logprobs=self.cfg.logprobs, router_loss=self.router_loss())

  def jit_update(self, mesh, t, optimizer, schedule):
    t = dataclasses.replace(t, frozen=(t.frozen, self.teacher and self.teacher.params),
                            frozen_shardings=(t.frozen_shardings, self.teacher and self.teacher.shardings))
    return jit_step(self.make_loss_fn(t.graphdef), optimizer, schedule, self.micro_batches(), mesh, t,
                    dropout_seed=dropout_seed(self.cfg), combine=_with_teacher)

  def step_frozen(self):
    return self.setup.frozen, self.teacher and self.teacher.params

  def loss_params(self, params):
    return params, self.teacher and self.teacher.params

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
    samples from its prompt (the tokens before its first loss token), cut to fit the largest bucket; a row without a
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
        completion = sampled.tokens[j, :sampled.lengths[j]][:max(self.buckets) - starts[i]]
        ids = np.concatenate([tokens[i, :starts[i]], completion]).astype(np.int32)
        mask = np.concatenate([np.zeros(starts[i], np.int32), np.ones(len(completion), np.int32)])
      examples.append({"tokens": ids, "loss_mask": mask, "record": np.full(len(ids), local["record"][i].max())})
    return pipeline.bucket_batch(self.buckets)(examples)

  # Evaluation --------------------------------------------------------------------------------------------------
  def evaluate(self, setup, params) -> dict:
    out = super().evaluate(setup, params)
    if out and self.teacher is not None:
      if self.teacher_match is None:
        self.teacher_match = exact_match(self.teacher.graphdef, self.teacher.params, self.eval_examples())
      out["eval/exact_match_teacher"] = self.teacher_match
    return out


def _encode_stored(record: dict, max_length: int) -> dict:
  """A replay-buffer record with the teacher's top-k -> an example: the prompt and response ids, the loss on the
  response, and the top-k ids and log-probs [T, k] at each response token's position (0 elsewhere)."""
  topk_ids, topk_logp = record.get("teacher_topk_ids"), record.get("teacher_topk_logprobs")
  if topk_ids is None or topk_logp is None:
    raise DataError("record has no teacher_topk_ids / teacher_topk_logprobs (a replay buffer written with "
                    "rollout.teacher_top_k has them)")
  prompt, response = list(record["prompt_ids"]), list(record["response_ids"])
  n = len(prompt) + len(response)
  if n > max_length:
    raise TooLong(f"{n} tokens, more than data.max_length={max_length}", length=n, limit=max_length)
  k = len(topk_ids[0]) if topk_ids else 0
  ids, logp = np.zeros((n, k), np.int32), np.zeros((n, k), np.float32)
  ids[len(prompt):], logp[len(prompt):] = topk_ids, topk_logp
  return {"tokens": np.asarray(prompt + response, np.int32), "loss_mask": np.asarray(
      [0] * len(prompt) + [1] * len(response), np.int32), "topk_ids": ids, "topk_logp": logp}


def _topk_batch(buckets: tuple[int, ...]):
  """Examples with top-k columns -> a bucketed batch (`pipeline.bucket_batch`) with them padded alike."""
  plain = pipeline.bucket_batch(buckets)

  def batch(examples: list[dict]) -> dict:
    out = plain(examples)
    length = out["tokens"].shape[1]
    for key in ("topk_ids", "topk_logp"):
      out[key] = np.stack([np.pad(e[key], ((0, length - len(e[key])), (0, 0))) for e in examples])
    return out
  return batch


class OnPolicyDistillTask(GrpoTask):
  """On-policy distillation: the GRPO learner, the teacher its reference, the reverse KL per token its reward."""

  def __init__(self, cfg: RunConfig):
    super().__init__(on_policy_config(cfg))
    self.distill = cfg.distill

  def make_reference(self, setup: Setup, logprobs_fn):
    """The live teacher (`distill.teacher`), or without one the teacher's log-probs a replay buffer stores
    (`grpo.buffer` written with `rollout.teacher`), which the update rows carry as `ref_logp` (`update_rows`)."""
    self.teacher = None
    if self.distill.teacher:
      self.teacher = Teacher.of_run(self.cfg, setup)
      return self.teacher.params, self.teacher.response_logprobs_fn(
          self.cfg.sampling.temperature, self.cfg.logprobs, self.group_size, out_shardings=self.batch_sharding)
    offline = self.stage.offline
    if offline is None or not offline.has_teacher():
      raise ConfigError(f"config.distill.teacher: empty, and config.grpo.buffer={self.cfg.grpo.buffer!r} "
                        f"{'is not set' if offline is None else 'holds no teacher log-probs'}; name the teacher, or "
                        "a buffer written with rollout.teacher")
    return None, lambda params, batch: batch.ref_logp

  def update_rows(self, trained: Groups) -> RolloutBatch:
    rows = super().update_rows(trained)
    return rows if self.teacher is not None else rows.replace(ref_logp=trained.teacher_logp)

  def build(self, setup: Setup, optimizer, schedule):
    iterator = super().build(setup, optimizer, schedule)
    self.teacher_accuracy = {}
    if self.eval_prompts:  # before a resume restores the state: the student as loaded, and the teacher
      self.initial = self._accuracies(self._policy(setup.full(setup.state.params)))
      if self.teacher is not None:
        self.teacher_accuracy = {"eval/accuracy_teacher": accuracy(
            self.teacher.module(), setup.tok, self.eval_prompts, self.metric, self.cfg.sampling.max_new_tokens)}
    return iterator

  def begin(self, state, start: int) -> None:
    self.step = start
    if self.initial:
      teacher = self.teacher_accuracy.get("eval/accuracy_teacher")
      self.say(f"held-out {self.metric} accuracy of the student {self.initial['eval/accuracy']:.4f}" +
               ("" if teacher is None else f", of the teacher {teacher:.4f}"))
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
