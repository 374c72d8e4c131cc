"""Distillation divergences between a student's and a teacher's next-token distributions.

`generalized_jsd` is the per-token divergence of TRL 1.16's `DistillationTrainer` (`trl.kernels.chunked_divergence`,
after Agarwal et al. 2024, GKD, Eq. 1): with p_s = softmax(student / T), p_t = softmax(teacher / T) and the mixture
m = (1 - beta) p_s + beta p_t,

  beta = 0:      KL(p_t || p_s)                               (forward KL: the student covers the teacher's modes)
  0 < beta < 1:  beta KL(p_t || m) + (1 - beta) KL(p_s || m)  (the generalized Jensen-Shannon divergence)
  beta = 1:      KL(p_s || p_t)                               (reverse KL: mode-seeking, on-policy distillation's)

The end points are the KLs themselves, as TRL computes them (the interpolated form tends to 0 there, not to the KLs).
The teacher is frozen: gradients reach the student's logits only. The same divergence from both models' hidden states
and unembeddings, never holding [tokens, vocab] logits: `jalign.kernels.full_divergence`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jalign.kernels.kl import log_divergence


def generalized_jsd(student_logits_XxV: jax.Array, teacher_logits_XxV: jax.Array, beta: float,
                    temperature: float = 1.0) -> jax.Array:
  """The divergence per position [X] (every leading axis kept) between softmax(student / temperature) and
  softmax(teacher / temperature) over the last axis (the shared vocabulary); in fp32 (fp64 for fp64 logits). `beta`
  in [0, 1] (see the module docstring); a Python number, as the end points are other formulas."""
  if not 0.0 <= beta <= 1.0:
    raise ValueError(f"generalized_jsd: beta={beta} must be in [0, 1] (0 forward KL, 1 reverse KL)")
  if temperature <= 0:
    raise ValueError(f"generalized_jsd: temperature={temperature} must be positive")
  if student_logits_XxV.shape[-1] != teacher_logits_XxV.shape[-1]:
    raise ValueError(f"generalized_jsd: student vocabulary {student_logits_XxV.shape[-1]} != teacher vocabulary "
                     f"{teacher_logits_XxV.shape[-1]}; slice both to the token ids they share")
  dtype = jnp.promote_types(student_logits_XxV.dtype, jnp.float32)
  log_ps = jax.nn.log_softmax(student_logits_XxV.astype(dtype) / temperature, axis=-1)
  log_pt = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits_XxV).astype(dtype) / temperature, axis=-1)
  return log_divergence(log_ps, log_pt, beta)


def on_policy_advantages(student_logp_BxT: jax.Array, teacher_logp_BxT: jax.Array, mask_BxT: jax.Array, *,
                         coef: float = 1.0, outcome_BxT: jax.Array | None = None) -> jax.Array:
  """On-policy distillation's advantages [B, T] of sampled tokens: each token's reward is -coef x (log pi_student -
  log pi_teacher) of that token (the single-sample estimate of the reverse KL, k1), with discount 0, so the advantage
  of a token is its own reward: no baseline, no whitening (Agarwal et al. 2024; Lu & Thinking Machines 2025,
  "On-policy distillation"). `outcome_BxT`: a sequence-level advantage (e.g. GRPO's of a verifiable reward) broadcast
  over the response, added. 0 off the mask (prompt, padding, tool observations)."""
  mask = mask_BxT.astype(jnp.float32)
  adv = -coef * (student_logp_BxT.astype(jnp.float32) - teacher_logp_BxT.astype(jnp.float32))
  if outcome_BxT is not None:
    adv = adv + outcome_BxT.astype(jnp.float32)
  return adv * mask


def topk_divergence(student_topk_logp_XxK: jax.Array, teacher_topk_logp_XxK: jax.Array, beta: float) -> jax.Array:
  """The divergence by `beta` (as `generalized_jsd`) between two distributions known on a teacher's top-k tokens
  only: each is taken over k + 1 outcomes, the k tokens and the rest of the vocabulary with the mass left over
  (the teacher's log-probs precomputed, the student's at the same token ids). The teacher is frozen. Leading axes
  kept; fp32."""
  def with_tail(logp):
    logp = logp.astype(jnp.float32)
    # < 0 so a tail is left; the tail's mass is known to fp32's resolution below 1 (2**-24), no finer
    covered = jnp.minimum(jax.nn.logsumexp(logp, axis=-1, keepdims=True), -2.0**-24)
    return jnp.concatenate([logp, jnp.log(-jnp.expm1(covered))], axis=-1)
  return log_divergence(with_tail(student_topk_logp_XxK), with_tail(jax.lax.stop_gradient(teacher_topk_logp_XxK)),
                        beta)
