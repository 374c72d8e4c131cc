"""Held-out evaluation of a policy checkpoint (any HF-format causal LM directory, jalign's or another tool's).

On held-out prompts with ground truth: task accuracy under a verifier (greedy pass@1, and the unbiased pass@k of
Chen et al. 2021 from n samples), mean response length, mean reward-model score, the win rate against a reference
policy (each prompt's greedy answers judged by a reward model or by the verifier; a tie counts half), and the KL to
the reference (per-sequence sum of log pi - log pi_ref over the policy's own samples). Optionally perplexity on
held-out SFT data, and a reward model's pairwise accuracy and rank correlation on held-out preference pairs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models
from jalign.core.errors import ConfigError, UserError
from jalign.core.sections import bounded
from jalign.data import preference
from jalign.data import sft as sft_data
from jalign.data.layouts import Fields
from jalign.data.prompts import Prompt, encode_prompt
from jalign.data.sources import DataError, open_source
from jalign.eval import ranking
from jalign.models.sharding import to_host
from jalign.objectives import grpo as grpo_objective
from jalign.objectives import sft as sft_objective
from jalign.parallel.distributed import say
from jalign.rewards.verifiable import NEEDS_GROUND_TRUTH, REGISTRY, Batch
from jalign.rl.batch import RolloutBatch
from jalign.rl.rollout import Samples, SamplingSection, concat, sample
from jalign.tokenizers import tokenizer as tokenizer_lib


@dataclasses.dataclass(frozen=True)
class EvalSection:
  """Held-out evaluation of a checkpoint (jalign.eval.policy)."""
  prompts: str = "synthetic:arith:test"   # held-out prompts with ground truth (any prompt source jalign reads)
  examples: int = bounded(256, gt=0)      # prompts evaluated (the first ones)
  metric: str = "gsm8k"                   # the verifier: a verifiable reward of jalign.rewards.verifiable
  max_new_tokens: int = bounded(16, gt=0)  # tokens generated per prompt
  num_samples: int = bounded(0, ge=0)     # n samples per prompt for pass@k; 0 = greedy only
  pass_k: tuple[int, ...] = (1,)          # k values for pass@k (each <= num_samples)
  temperature: float = 1.0                # of the samples (pass@k and the KL estimate)
  reference: str = ""                     # HF dir of a reference policy: win rate and KL against it
  reward_model: str = ""                  # HF *ForSequenceClassification or ensemble dir: mean score (and judge)
  judge: Literal["auto", "reward_model", "verifier"] = "auto"  # win rate judge; auto = the reward model if any
  sft_data: str = ""                      # held-out SFT data: perplexity
  pairs: str = ""                         # held-out preference pairs: the reward model's pairwise accuracy, Spearman
  batch_size: int = bounded(128, gt=0)    # prompts (or pairs) per forward
  seed: int = 0                           # sampling (pass@k)

  def check(self, model_path: str) -> None:
    if not model_path:
      raise ConfigError("config.model.path: empty; task 'eval' evaluates an HF checkpoint directory")
    if self.num_samples and any(k < 1 or k > self.num_samples for k in self.pass_k):
      raise ConfigError(f"config.eval.pass_k={self.pass_k}: each k must be in [1, eval.num_samples="
                        f"{self.num_samples}]")
    if (self.num_samples or self.reference) and self.temperature <= 0:
      raise ConfigError(f"config.eval.temperature={self.temperature}: samples (pass@k, the KL estimate) need a "
                        "temperature > 0")
    if self.judge == "reward_model" and not self.reward_model:
      raise ConfigError("config.eval.judge='reward_model' needs config.eval.reward_model")
    if self.metric not in NEEDS_GROUND_TRUTH:
      raise ConfigError(f"config.eval.metric={self.metric!r}; accepted verifiers: "
                        f"{', '.join(sorted(NEEDS_GROUND_TRUTH))}")



def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k), in the numerically stable
  product form of Chen et al. 2021 (arXiv:2107.03374)."""
  if k > n:
    raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def win_rate(policy_scores, reference_scores, *, tie_tolerance: float = 0.0) -> dict[str, float]:
  """Pairwise comparison per prompt: a win when the policy's score is higher by more than `tie_tolerance`, a tie
  within it (counted half, as AlpacaEval and MT-Bench pairwise judging do)."""
  diff = np.asarray(policy_scores, np.float64) - np.asarray(reference_scores, np.float64)
  wins, losses = float(np.mean(diff > tie_tolerance)), float(np.mean(diff < -tie_tolerance))
  ties = 1.0 - wins - losses
  return {"win_rate": wins + 0.5 * ties, "wins": wins, "ties": ties, "losses": losses}


def generate(lm, tok, prompts: list[Prompt], *, max_new_tokens: int, temperature: float, n: int = 1, seed: int = 0,
             batch_size: int = 128) -> Samples:
  """`n` completions of each prompt, sampled `batch_size` prompts at a time."""
  spec = SamplingSection(max_new_tokens=max_new_tokens, temperature=temperature, num_samples=n)
  return concat([sample(lm, tok, prompts[start:start + batch_size], jax.random.fold_in(jax.random.key(seed), start),
                        spec) for start in range(0, len(prompts), batch_size)])


def verify(metric: str, r: Samples) -> np.ndarray:
  return np.asarray(REGISTRY[metric](Batch(r.texts, r.truths(), r.lengths)), np.float64)


def accuracy(lm, tok, prompts: list[Prompt], metric: str, max_new_tokens: int, batch_size: int = 128) -> float:
  """Greedy pass@1 under the verifier `metric` (the held-out accuracy the training loops print)."""
  greedy = generate(lm, tok, prompts, max_new_tokens=max_new_tokens, temperature=0.0, batch_size=batch_size)
  return float(np.mean(verify(metric, greedy)))


@functools.lru_cache(maxsize=8)
def _logprob_fn(graphdef, temperature: float):
  return jax.jit(lambda params, batch: grpo_objective.response_logprobs(graphdef, params, batch, temperature)[0])


def sequence_logprobs(lm, r: Samples, pad_id: int, temperature: float, batch_size: int) -> np.ndarray:
  """Summed log-probs [N*n] of each response under `lm` (the sampling distribution at `temperature`)."""
  graphdef, params = nnx.split(lm)
  fn = _logprob_fn(graphdef, temperature)
  batch = RolloutBatch.of_rows(*r.prompt_arrays(pad_id), r.tokens, r.lengths)
  out = []
  for start in range(0, len(r.tokens), batch_size):
    part = jax.tree.map(jnp.asarray, batch.slice(start, start + batch_size))
    logp = to_host(fn(params, part))
    out.append(np.sum(logp * batch.response_mask[start:start + batch_size], axis=1))
  return np.concatenate(out)


def reward_scores(rm_path: str, r: Samples, pad_id: int) -> np.ndarray:
  from jalign.rewards.learned import ModelReward
  rm = ModelReward(rm_path, 1.0, None)
  ids, mask = r.prompt_arrays(pad_id)
  return np.concatenate([rm(ids[s:s + 128], mask[s:s + 128], r.tokens[s:s + 128], r.lengths[s:s + 128])
                         for s in range(0, len(ids), 128)])


def _encoded(spec: str, encode, fields: Fields = Fields()) -> list[dict]:
  """The records of `spec` that `encode` accepts (a held-out check reads what it can, as a training run that skips
  bad records would)."""
  source = open_source(spec, fields)
  out = []
  for i in range(len(source)):
    try:
      out.append(encode(source[i]))
    except DataError:
      continue
  return out


def perplexity(lm, tok, spec: str, *, max_length: int, batch_size: int, fields: Fields = Fields()) -> float:
  """exp(mean NLL per loss token) over the SFT records of `spec` (completion / assistant tokens)."""
  examples = _encoded(spec, functools.partial(sft_data.encode, tok=tok, max_length=max_length), fields)
  graphdef, params = nnx.split(lm)
  loss_fn = jax.jit(sft_objective.make_loss_fn(graphdef))
  nll, count = 0.0, 0.0
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    length = 1 << (max(len(e["tokens"]) for e in chunk) - 1).bit_length()
    tokens = np.zeros((batch_size, length), np.int32)
    loss_mask = np.zeros_like(tokens)
    segment = np.zeros_like(tokens)
    for i, e in enumerate(chunk):
      n = len(e["tokens"])
      tokens[i, :n], loss_mask[i, :n], segment[i, :n] = e["tokens"], e["loss_mask"], 1
    batch = {"tokens": tokens, "loss_mask": loss_mask, "segment_ids": segment,
             "positions": np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)}
    s, w, _ = loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()})
    nll, count = nll + float(s), count + float(w)
  return math.exp(nll / count) if count else float("nan")


def pair_metrics(rm_path: str, tok, spec: str, *, max_length: int, batch_size: int, limit: int = 0,
                 fields: Fields = Fields()) -> dict:
  """A reward model's (or ensemble's: weighted sum of its members' scores) pairwise accuracy (chosen scored above
  rejected) and, with gold scores, Spearman / Kendall, over the first `limit` pairs of `spec` (0 = all)."""
  from jalign.objectives.reward import pair_scores
  from jalign.rewards.ensemble import load_scorers
  examples = _encoded(spec, functools.partial(preference.encode, tok=tok, max_length=max_length), fields)
  examples = examples[:limit] if limit else examples
  batches = []
  for start in range(0, len(examples), batch_size):
    chunk = examples[start:start + batch_size]
    longest = max(max(len(e["chosen"]), len(e["rejected"])) for e in chunk)
    batch = preference.pair_batch((1 << (longest - 1).bit_length(),))(chunk)
    batches.append({k: jnp.asarray(v) for k, v in batch.items() if k in ("tokens", "segment_ids", "positions")})
  total = 0.0
  for rm, weight in load_scorers(rm_path):
    graphdef, params = nnx.split(rm)
    fn = jax.jit(lambda p, b, g=graphdef: pair_scores(nnx.merge(g, p), b))
    total = total + weight * np.concatenate([to_host(fn(params, b)) for b in batches])
  # the encoded pairs keep their gold scores, so the correlations pair each score with its own record
  return {"rm/" + k: v for k, v in ranking.pair_metrics(total, examples).items()}


def load_prompts(e: EvalSection, tok, max_prompt_length: int, fields: Fields = Fields()) -> list[Prompt]:
  source = open_source(e.prompts, fields)
  return [encode_prompt(source[i], tok, index=i, where=source.where(i), max_length=max_prompt_length)
          for i in range(min(len(source), e.examples))]


def _load_reference(e: EvalSection, path: str, lm, prompts: list[Prompt]):
  """The reference policy; a ConfigError naming it when it cannot score the model's samples: another vocabulary
  (the KL and the win rate compare the two models on the same token ids) or a context too short for the prompts."""
  try:
    ref = models.from_pretrained(e.reference, dtype="float32")
  except UserError as err:
    raise ConfigError(f"config.eval.reference={e.reference!r}: {err}") from None
  longest = max(len(p.ids) for p in prompts) + e.max_new_tokens
  problem = None
  if ref.cfg.vocab_size != lm.cfg.vocab_size:
    problem = f"its vocabulary has {ref.cfg.vocab_size} tokens, the model's {lm.cfg.vocab_size}"
  elif ref.cfg.max_position_embeddings < longest:
    problem = (f"its context is {ref.cfg.max_position_embeddings} positions, the longest prompt plus "
               f"eval.max_new_tokens {longest}")
  if problem:
    raise ConfigError(f"config.eval.reference={e.reference!r} cannot be compared with config.model.path={path!r}: "
                      f"{problem}. Give a reference with the model's tokenizer (e.g. the model before training), or "
                      "eval.reference='' to leave out the win rate and the KL")
  return ref


def shown_samples(r: Samples, scores: np.ndarray, k: int) -> list[dict]:
  """The first `k` completions of `r`, decoded, with their scores: what a reader checks first when a reward never
  fires."""
  return [{"prompt": p.text, "completion": text, "reward": float(score), "ground_truth": p.ground_truth,
           "where": p.where} for p, text, score in list(zip(r.owners(), r.texts, scores))[:k]]


def evaluate(e: EvalSection, path: str, *, tokenizer: str = "", fields: Fields = Fields(),
             show: Callable[[list[dict]], None] | None = None, shown: int = 2) -> dict[str, float]:
  """Every metric the section asks for, for the HF checkpoint at `path` (see the module doc); `show` gets the first
  `shown` greedy answers with their verifier scores. Says what it does as it goes."""
  if e.metric not in REGISTRY or e.metric not in NEEDS_GROUND_TRUTH:
    raise ConfigError(f"eval.metric={e.metric!r}: accepted verifiers: {', '.join(sorted(NEEDS_GROUND_TRUTH))}")
  if e.num_samples and any(k > e.num_samples for k in e.pass_k):
    raise ConfigError(f"eval.pass_k={e.pass_k}: every k must be <= eval.num_samples={e.num_samples}")
  started = time.perf_counter()
  tick = lambda: f"{time.perf_counter() - started:.0f} s"  # noqa: E731
  tok = tokenizer_lib.load(tokenizer or path)
  lm = models.from_pretrained(path, dtype="float32")
  max_prompt = lm.cfg.max_position_embeddings - e.max_new_tokens
  prompts = load_prompts(e, tok, max_prompt, fields)
  ref = _load_reference(e, path, lm, prompts) if e.reference else None
  say(f"eval: {len(prompts)} prompts of {e.prompts}, greedy answers of {path} ({tick()})")
  gen = functools.partial(generate, tok=tok, prompts=prompts, max_new_tokens=e.max_new_tokens,
                          batch_size=e.batch_size)
  greedy = gen(lm, temperature=0.0)
  correct = verify(e.metric, greedy)
  if show is not None:
    show(shown_samples(greedy, correct, shown))
  out = {"eval/accuracy": float(np.mean(correct)), "eval/response_length": float(np.mean(greedy.lengths)),
         "eval/prompts": float(len(prompts))}
  say(f"eval: accuracy {out['eval/accuracy']:.4f} ({tick()})")
  samples = None
  if e.num_samples:
    say(f"eval: {e.num_samples} samples per prompt for pass@k ({tick()})")
    samples = gen(lm, temperature=e.temperature, n=e.num_samples, seed=e.seed)
    hits = (verify(e.metric, samples) > 0.5).reshape(len(prompts), e.num_samples).sum(1)
    for k in e.pass_k:
      out[f"eval/pass@{k}"] = float(np.mean([pass_at_k(e.num_samples, int(c), k) for c in hits]))
  rm_greedy = None
  if e.reward_model:
    rm_greedy = reward_scores(e.reward_model, greedy, tok.pad_id)
    out["eval/rm_score"] = float(np.mean(rm_greedy))
  if ref is not None:
    say(f"eval: the reference {e.reference}: greedy answers, win rate and KL ({tick()})")
    ref_greedy = gen(ref, temperature=0.0)
    judge = e.judge if e.judge != "auto" else ("reward_model" if e.reward_model else "verifier")
    if judge == "reward_model":
      if not e.reward_model:
        raise ConfigError("eval.judge='reward_model' needs eval.reward_model")
      mine, theirs = rm_greedy, reward_scores(e.reward_model, ref_greedy, tok.pad_id)
    else:
      mine, theirs = correct, verify(e.metric, ref_greedy)
    out.update({f"eval/{k}": v for k, v in win_rate(mine, theirs).items()})
    out["eval/reference_accuracy"] = float(np.mean(verify(e.metric, ref_greedy)))
    own = samples if samples is not None else gen(lm, temperature=e.temperature, n=1, seed=e.seed)
    temperature = e.temperature if e.temperature > 0 else 1.0
    kl = (sequence_logprobs(lm, own, tok.pad_id, temperature, e.batch_size)
          - sequence_logprobs(ref, own, tok.pad_id, temperature, e.batch_size))
    out["eval/kl_to_reference"] = float(np.mean(kl))
  if e.sft_data:
    say(f"eval: perplexity on {e.sft_data} ({tick()})")
    out["eval/perplexity"] = perplexity(lm, tok, e.sft_data, max_length=lm.cfg.max_position_embeddings,
                                        batch_size=e.batch_size, fields=fields)
  if e.pairs and e.reward_model:
    out.update(pair_metrics(e.reward_model, tok, e.pairs, max_length=lm.cfg.max_position_embeddings,
                            batch_size=e.batch_size, fields=fields))
  return out
