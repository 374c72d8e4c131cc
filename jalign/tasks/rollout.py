"""The offline rollout task: prompts -> n completions each -> rewards -> a replay buffer on disk.

Prompts are processed in a fixed order in batches; batch b is written as buffer part b, and batch b's sampling key
is fold_in(seed, b). A rerun skips the parts already on disk, so an interrupted rollout completes with every prompt
exactly once and the same samples it would have drawn uninterrupted. With `rollout.teacher`, a teacher scores every
sampled token and its log-probs join each record (`teacher_logprobs`): on-policy distillation then reads them from
the buffer instead of running the teacher beside the trainer.
"""
from __future__ import annotations

import functools
import os
import time

import jax
import numpy as np

from jalign import parallel
from jalign.config import RunConfig
from jalign.core.files import output_path
from jalign.data.prompts import PromptError, check_prompts, encode_prompt, left_pad_ids
from jalign.data.sources import open_source
from jalign.kernels.logprobs import LogprobOptions
from jalign.models.sharding import to_host
from jalign.parallel.distributed import say
from jalign.rl.batch import RolloutBatch
from jalign.rl.buffer import BufferWriter
from jalign.rl.rollout import rollout_batch
from jalign.tokenizers import tokenizer as tokenizer_lib
from jalign.train.task import load_model


def run(cfg: RunConfig) -> dict:
  mesh = parallel.mesh_from_config(cfg.mesh.shape)
  tok = tokenizer_lib.load(cfg.tokenizer or cfg.model.path)
  lm = load_model(cfg, mesh)
  s = cfg.sampling
  max_prompt = min(s.max_prompt_length, lm.cfg.max_position_embeddings - s.max_new_tokens)
  rewards = cfg.reward.spec()
  model_reward = None
  if cfg.reward.model:
    from jalign.rewards.learned import ModelReward
    model_reward = ModelReward(cfg.reward.model, cfg.reward.model_weight, mesh, cfg.mesh.rules)
  source = open_source(cfg.rollout.prompts, cfg.data.fields())
  total = min(len(source), cfg.rollout.limit) if cfg.rollout.limit else len(source)
  if total == 0:
    raise PromptError(f"{cfg.rollout.prompts}: no prompts")
  encode = functools.partial(encode_prompt, tok=tok, max_length=max_prompt)
  tally = check_prompts(source, encode, limit=min(total, cfg.data.check_records or total))
  say(f"prompts {cfg.rollout.prompts}: {tally.summary()}")
  score_teacher = _teacher(cfg, tok, lm, mesh) if cfg.rollout.teacher else None
  out_dir = output_path(cfg.run_dir, cfg.rollout.output or "buffer")  # validated to lie inside run_dir
  writer = BufferWriter(out_dir, cfg.rollout.format)
  per_batch = cfg.rollout.prompts_per_batch
  n_batches = -(-total // per_batch)
  done = writer.completed_parts()
  policy_id = os.path.abspath(cfg.model.path) if cfg.model.path else f"scratch:{cfg.seed}"
  key = jax.random.key(cfg.seed)
  kept = dropped = new_tokens = 0
  rewards_sum, rewards_n = 0.0, 0
  start = time.perf_counter()
  from tqdm import tqdm
  bar = tqdm(total=n_batches, initial=len(done & set(range(n_batches))), desc="rollout", disable=None)
  with jax.set_mesh(mesh):
    for b in range(n_batches):
      if b in done:
        continue
      prompts = []
      for i in range(b * per_batch, min((b + 1) * per_batch, total)):
        prompts.append(encode(source[i], index=i, where=source.where(i)))
      records, stats = rollout_batch(lm, tok, prompts, jax.random.fold_in(key, b), s, rewards, policy_id,
                                     mesh=mesh, rules=s.rules(cfg.mesh.rules), model_reward=model_reward)
      rewards_sum += stats["rollout/reward_mean"] * len(records)
      rewards_n += len(records)
      new_tokens += stats["rollout/new_tokens"]
      if cfg.rollout.min_reward is not None:
        before = len(records)
        records = [r for r in records if r["reward"] >= cfg.rollout.min_reward]
        dropped += before - len(records)
      if score_teacher is not None and records:
        score_teacher(records)
      kept += len(records)
      writer.write(b, records)
      bar.update(1)
      bar.set_postfix({"reward": f"{stats['rollout/reward_mean']:.3f}",
                       "tok/s": f"{new_tokens / (time.perf_counter() - start):.0f}"}, refresh=False)
  bar.close()
  elapsed = time.perf_counter() - start
  summary = {"rollout/batches_written": float(n_batches - len(done)), "rollout/records_kept": float(kept),
             "rollout/records_dropped": float(dropped),
             "rollout/reward_mean": rewards_sum / rewards_n if rewards_n else float("nan"),
             "perf/new_tokens_per_s": new_tokens / elapsed if elapsed else 0.0}
  print(f"buffer: {out_dir} ({n_batches} parts)", flush=True)
  return summary


def _teacher(cfg: RunConfig, tok, lm, mesh):
  """records -> None: `rollout.teacher`'s log-probs of each record's response tokens added as `teacher_logprobs` (at
  the sampling temperature, as the sampler's), with `teacher` naming it; with `rollout.teacher_top_k`, its k likeliest
  tokens at each response position and their log-probs (temperature 1)."""
  from jalign.tasks.distill import Teacher
  s = cfg.sampling
  teacher = Teacher.load(cfg.rollout.teacher, key="rollout.teacher", tokenizer="", dtype=cfg.model.dtype,
                         student_tok=tok, student_cfg=lm.cfg, mesh=mesh, rules=cfg.mesh.rules,
                         knobs=cfg.model.knobs())
  logprobs = teacher.response_logprobs_fn(s.temperature or 1.0, LogprobOptions())
  k = cfg.rollout.teacher_top_k
  topk = teacher.response_topk_fn(k) if k else None
  name = os.path.abspath(cfg.rollout.teacher)

  def score(records: list[dict]) -> None:
    ids, mask = left_pad_ids([r["prompt_ids"] for r in records], tok.pad_id)
    lengths = np.asarray([len(r["response_ids"]) for r in records])
    response = np.full((len(records), s.max_new_tokens), tok.pad_id, np.int32)
    for row, r in enumerate(records):
      response[row, :lengths[row]] = r["response_ids"]
    batch = RolloutBatch.of_rows(ids, mask, response, lengths)
    logp = to_host(logprobs(teacher.params, batch))
    for row, r in enumerate(records):
      r.update(teacher_logprobs=logp[row, :lengths[row]].astype(float).tolist(), teacher=name)
    if topk is not None:
      top_logp, top_ids = to_host(topk(teacher.params, batch))
      for row, r in enumerate(records):
        r.update(teacher_topk_ids=top_ids[row, :lengths[row]].tolist(),
                 teacher_topk_logprobs=top_logp[row, :lengths[row]].astype(float).tolist())
  return score
