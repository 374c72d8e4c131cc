"""Supervised fine-tuning: next-token NLL on completion / assistant tokens, token-mean over the global batch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import kernels
from jalign.models.sharding import to_host
from jalign.objectives import router


def targets_and_weights(batch: dict):
  """Next-token targets [B, T] and their weights: the target is a loss token of the same packed sequence. The last
  position gets weight 0 instead of being sliced off, so the head runs on T (not T-1) rows: aligned shapes are
  markedly faster on CPU."""
  shift = lambda x: jnp.pad(x[:, 1:], ((0, 0), (0, 1)))
  tokens, seg = batch["tokens"], batch["segment_ids"]
  weights = shift(batch["loss_mask"]) * (shift(seg) == seg) * (seg != 0)
  return shift(tokens), weights.astype(jnp.float32)


def make_loss_fn(graphdef, *, logprobs: kernels.LogprobOptions = kernels.LogprobOptions(),
                 router_loss: router.RouterLoss = router.RouterLoss()):
  """MoE models add `router_loss`'s penalty (per token, like the NLL) and report the routing metrics."""
  def loss_fn(params, batch):
    lm = nnx.merge(graphdef, params)
    hidden, _, routing = lm.forward_routed(batch["tokens"], segment_ids=batch["segment_ids"],
                                           positions=batch["positions"], dropout_rng=batch.get("dropout_rng"))
    targets, weights = targets_and_weights(batch)
    logp, _, _ = kernels.token_logprobs(hidden, lm.unembed(), targets, softcap=lm.cfg.final_softcap,
                                        **logprobs.kwargs())
    loss_sum, weight = -jnp.sum(logp * weights), jnp.sum(weights)
    if routing is None:
      return loss_sum, weight, {}
    penalty, metrics = router.terms(routing, lm.cfg, router_loss)
    return loss_sum + penalty * weight, weight, {k: v * weight for k, v in metrics.items()}
  return loss_fn


def exact_match(graphdef, params, examples: list[dict], *, batch_size: int = 64) -> float:
  """Fraction of examples whose every loss token is the model's argmax given the true prefix. For a completion that
  ends with eos this is exactly "greedy decoding reproduces the reference answer"."""
  @jax.jit
  def correct(params, tokens, loss_mask):
    lm = nnx.merge(graphdef, params)
    logits = lm(tokens)[:, :-1]  # right padding cannot affect earlier positions (causal)
    hit = (jnp.argmax(logits, -1) == tokens[:, 1:]) | (loss_mask[:, 1:] == 0)
    return jnp.all(hit, axis=-1)

  hits = []
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    length = max(len(e["tokens"]) for e in chunk)
    length = 1 << (length - 1).bit_length()  # power-of-two buckets: few compiles
    tokens = np.zeros((batch_size, length), np.int32)
    mask = np.zeros((batch_size, length), np.int32)
    for i, e in enumerate(chunk):
      tokens[i, :len(e["tokens"])] = e["tokens"]
      mask[i, :len(e["loss_mask"])] = e["loss_mask"]
    hits.extend(to_host(correct(params, jnp.asarray(tokens), jnp.asarray(mask)))[:len(chunk)].tolist())
  return float(np.mean(hits)) if hits else 0.0
