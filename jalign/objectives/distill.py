"""Distillation of a frozen teacher into the student that trains (the run config's `distill` section).

- `offline`: knowledge distillation on a dataset (the SFT layouts): the loss is the generalized JSD between the
  student's and the teacher's next-token distributions at every completion token (`losses.distill`), token-mean over
  the global batch, plus `sft_weight` x the completion tokens' cross-entropy.
- `gkd`: Agarwal et al. 2024 (GKD) as TRL's `GKDTrainer` runs it: each batch, with probability `lmbda`, the student
  samples the completions of the batch's prompts first; the same loss then runs on them.
- `on_policy`: the student samples with the rollout engine and learns with the RL update: each sampled token's
  reward is -(log pi_student - log pi_teacher) (the per-token reverse KL, as in Agarwal et al. 2024 and Lu & Thinking
  Machines 2025, "On-policy distillation"), with discount 0 (`losses.distill.on_policy_advantages`).

The loss of the first two sees both models' hidden states and unembeddings (`kernels.full_divergence`): neither
[tokens, vocab] logits tensor is held.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx

from jalign import kernels
from jalign.core.sections import bounded
from jalign.kernels.logprobs import AUTO_XLA_VOCAB
from jalign.losses.distill import topk_divergence
from jalign.objectives import router
from jalign.objectives.sft import targets_and_weights

MODES = ("offline", "gkd", "on_policy")


@dataclasses.dataclass(frozen=True)
class DistillSection:
  """The run config's `distill` section (task 'distill')."""
  mode: Literal[MODES] = "offline"        # offline KD on data.train, gkd (some batches the student's samples) or
                                          # on_policy (the student samples every step; the RL update)
  teacher: str = ""                       # the teacher: an HF checkpoint directory or a .gguf file ("" on-policy
                                          # from a grpo.buffer written with rollout.teacher: its stored log-probs)
  teacher_tokenizer: str = ""             # its tokenizer directory; "" = distill.teacher
  teacher_dtype: Literal["", "float32", "bfloat16"] = ""  # the teacher's parameters; "" = model.dtype
  beta: float = bounded(1.0, ge=0, le=1)  # offline / gkd: 0 forward KL(teacher || student), 1 reverse KL, between:
                                          # the generalized JSD (TRL DistillationConfig.beta, default 1)
  temperature: float = bounded(1.0, gt=0)  # offline / gkd: both models' logits divided by it in the divergence
  sft_weight: float = bounded(0.0, ge=0)  # offline / gkd: + this x the completion tokens' cross-entropy
  lmbda: float = bounded(0.5, ge=0, le=1)  # gkd: the fraction of batches on the student's own samples (TRL
                                          # GKDConfig.lmbda, default 0.5); sampled with the sampling section
  coef: float = bounded(1.0, gt=0)        # on_policy: weight of the per-token reverse-KL reward
  reward_weight: float = bounded(0.0, ge=0)  # on_policy: + this x the group advantage (GRPO's) of the verifiable
                                          # reward (the reward section); 0 = distillation alone


def make_loss_fn(student_graphdef, teacher_graphdef, d: DistillSection, *, vocab: int,
                 logprobs: kernels.LogprobOptions = kernels.LogprobOptions(),
                 router_loss: router.RouterLoss = router.RouterLoss()):
  """loss_fn((student_params, teacher_params), batch) -> (loss_sum, weight, metric_sums) on SFT batches (packed or
  bucketed rows): the divergence summed over the completion tokens, plus `sft_weight` x their NLL. Both models'
  distributions are over the first `vocab` ids (the ids the tokenizers share; padded embedding rows left out).

  A batch with the teacher's precomputed top-k (`topk_ids`, `topk_logp` [B, T, k]: a replay buffer's, written with
  rollout.teacher_top_k) needs no teacher: the divergence is over those k tokens and the rest of the vocabulary
  (`losses.distill.topk_divergence`); teacher_params may then be None. An MoE student adds `router_loss`'s penalty
  per completion token and reports the routing metrics (as SFT); the teacher's router trains nothing."""
  impl = "xla" if vocab <= AUTO_XLA_VOCAB else "auto"

  def loss_fn(params, batch):
    student_params, teacher_params = params
    lm = nnx.merge(student_graphdef, student_params)
    where = dict(segment_ids=batch["segment_ids"], positions=batch["positions"])
    hidden, _, routing = lm.forward_routed(batch["tokens"], **where, dropout_rng=batch.get("dropout_rng"))
    targets, weights = targets_and_weights(batch)
    unembed, cap = lm.unembed()[:, :vocab], lm.cfg.final_softcap
    logp = lse = None
    if d.sft_weight or "topk_ids" in batch:
      logp, _, lse = kernels.token_logprobs(hidden, unembed, targets, softcap=cap, mask_T=weights,
                                           **logprobs.kwargs())
    if "topk_ids" in batch:
      div = _stored_topk_divergence(hidden, unembed, cap, lse, batch, d.beta)
    else:
      teacher = nnx.merge(teacher_graphdef, jax.lax.stop_gradient(teacher_params))
      teacher_hidden, _ = teacher.forward(batch["tokens"], **where)
      div = kernels.full_divergence(hidden, unembed, teacher_hidden, teacher.unembed()[:, :vocab], beta=d.beta,
                                    temperature=d.temperature, softcap=cap, mask_T=weights, impl=impl)
    div_sum = jnp.sum(div * weights)
    sums = {"distill/divergence": div_sum}
    loss = div_sum
    if d.sft_weight:
      nll = -jnp.sum(logp * weights)
      sums["distill/nll"] = nll
      loss = loss + d.sft_weight * nll
    if routing is not None:
      penalty, metrics = router.terms(routing, lm.cfg, router_loss)
      loss = loss + penalty * jnp.sum(weights)
      sums.update({k: v * jnp.sum(weights) for k, v in metrics.items()})
    return loss, jnp.sum(weights), sums
  return loss_fn


def _stored_topk_divergence(hidden_BxTxD, unembed_DxV, cap, lse_BxT, batch, beta: float):
  """The divergence at every position against the teacher's stored top-k of the next token (temperature 1): the
  student's log-probs of those k ids are its capped logits there minus its logsumexp over the vocabulary."""
  shift = lambda x: jnp.pad(x[:, 1:], ((0, 0), (0, 1), (0, 0)))  # noqa: E731  (as targets_and_weights)
  ids_BxTxK, teacher_BxTxK = shift(batch["topk_ids"]), shift(batch["topk_logp"])
  columns_DxBxTxK = jnp.take(unembed_DxV, ids_BxTxK, axis=1)
  z = jnp.einsum("btd,dbtk->btk", hidden_BxTxD, columns_DxBxTxK.astype(hidden_BxTxD.dtype),
                 preferred_element_type=jnp.float32)
  z = z if cap is None else jnp.tanh(z / cap) * cap
  return topk_divergence(z - lse_BxT[..., None], teacher_BxTxK, beta)
