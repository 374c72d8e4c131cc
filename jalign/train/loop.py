"""The training loop shared by every objective: model and data on the mesh, jitted step, checkpoints, metrics.

Step N+1 is dispatched before step N's metrics are read back, so the host never waits on the device just to log.
SIGTERM (how Cloud TPU spot VMs and Kubernetes preempt) or Ctrl-C finishes the current step, saves it and stops with
`preemption.Preempted` (exit status 143 or 130); see jalign/train/preemption.py.
"""
from __future__ import annotations

import os
import time

import jax
from flax import nnx

from jalign import parallel
from jalign.config import RunConfig, as_dict
from jalign.core.errors import ConfigError
from jalign.models import lora
from jalign.tokenizers import tokenizer as tokenizer_lib
from jalign.train import optimizer as optim_lib
from jalign.train.checkpoint import Checkpointer, abstract_like
from jalign.train.metrics import MetricsWriter, flops_per_token, peak_flops, to_floats
from jalign.train.preemption import Preemption
from jalign.train.step import trainable
from jalign.train.task import Setup, StepOut, Task


def setup(cfg: RunConfig, optimizer, task: Task | None = None) -> Setup:
  task = task or Task(cfg)
  try:
    mesh, rollout_mesh = parallel.split_meshes(cfg.mesh.shape, task.rollout_mesh_shape())
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  tok = tokenizer_lib.load(cfg.tokenizer or cfg.model.path)
  lm = task.load_model(cfg, mesh)
  if cfg.model.lora.rank:
    lora.add_adapters(getattr(lm, "backbone", lm), cfg.model.lora, seed=cfg.seed)
  if tok.vocab_size > lm.cfg.vocab_size:
    raise ConfigError(f"tokenizer {cfg.tokenizer or cfg.model.path} has {tok.vocab_size} tokens, more than the "
                     f"model's vocab_size {lm.cfg.vocab_size}")
  t = trainable(lm, optimizer, mesh, cfg.mesh.rules)
  return Setup(cfg, mesh, tok, t.graphdef, lm.cfg, t.state, t.state_shardings, t.frozen, t.frozen_shardings,
               rollout_mesh)


class NonFiniteError(RuntimeError):
  """A step's loss or gradient was NaN/Inf under train.nonfinite='stop' (the update was not applied)."""


def nonfinite_message(step: int, metrics: dict, records: list[str], ckpt_dir: str, latest: int | None) -> str:
  shown = ", ".join(records[:10]) + (f" and {len(records) - 10} more" if len(records) > 10 else "")
  return (f"step {step}: non-finite loss or gradient (train/loss={metrics.get('train/loss')}, train/grad_norm="
          f"{metrics.get('train/grad_norm')}); the update was not applied. Records in the batch: "
          f"{shown or 'unknown'}. Last good checkpoint: "
          f"{f'{ckpt_dir}/{latest}' if latest is not None else 'none yet'}. Lower optim.lr, check the data, or set "
          "train.nonfinite='skip' to skip such steps")


def run(cfg: RunConfig, task: Task) -> dict:
  """Trains `cfg.train.steps` steps of `task` (resuming if a checkpoint exists); returns the final metrics."""
  optimizer, lr_schedule = optim_lib.make(cfg.optim, cfg.train.steps)
  s = setup(cfg, optimizer, task)
  task.start(s)
  iterator = task.build(s, optimizer, lr_schedule)

  ckpt = Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                      async_save=cfg.checkpoint.async_save)
  state = s.state
  start = 0
  latest = ckpt.latest_intact_step() if cfg.checkpoint.resume else None
  if latest is not None:
    extra = task.extra_state()
    if extra is None:
      state = ckpt.restore(latest, abstract_like(state), iterator)
    else:
      state, extra = ckpt.restore(latest, abstract_like(state), iterator, abstract_extra=abstract_like(extra))
      task.load_extra_state(extra)
    host = ckpt.restore_host(latest)
    if host is not None:
      task.load_host_state(host)
    start = latest
  config_dict = as_dict(cfg)
  writer = MetricsWriter(cfg.log, cfg.run_dir, cfg.train.steps, start, config_dict)
  task.log = writer
  if latest is not None:
    writer.print(f"resumed from {ckpt.directory}/{latest}")

  fpt = flops_per_token(s.model_cfg, cfg.train.seq_len)
  peak = peak_flops(cfg.log.peak_flops)
  final: dict[str, float] = {}
  last_time = time.perf_counter()

  def evaluate_now(step: int, params, last: bool = False) -> dict:
    out = task.eval_loss(params) if task.eval_loss is not None else {}
    out.update(task.evaluate(s, params))
    if out:
      writer.write(step, out)
      writer.print(task.eval_message(step, out, last))
    return out

  def save(step: int):
    ckpt.save(step, state, iterator, config_dict, extra=task.extra_state(), host=task.host_state())

  def flush(step: int, out: StepOut) -> dict:
    nonlocal last_time
    m = to_floats(out.metrics)
    if any(v > 0 for k, v in m.items() if k.endswith("/nonfinite")):
      if cfg.train.nonfinite == "stop":
        ckpt.wait()
        raise NonFiniteError(nonfinite_message(step, m, task.where(out.records), ckpt.directory,
                                               ckpt.latest_step()))
      skipped = sum(v for k, v in m.items() if k.endswith("/skipped_nonfinite"))
      writer.print(f"step {step}: non-finite loss or gradient; update skipped ({int(skipped)} so far)")
    now = time.perf_counter()
    elapsed, last_time = now - last_time, now
    if out.tokens:
      m["perf/tokens_per_s"] = out.tokens / max(elapsed, 1e-9)
      m["perf/step_time_s"] = elapsed
      if peak:
        m["perf/mfu"] = m["perf/tokens_per_s"] * fpt / (peak * jax.device_count())
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
      writer.write(step, m)
    writer.advance()
    return m

  with Preemption(cfg.checkpoint.preempt_grace_s, ckpt.newest_complete) as preempt, jax.set_mesh(s.mesh):
    task.begin(state, start)
    pending = None  # (step, StepOut) whose device metrics are read back after the next step is dispatched
    step, stopped = start, False
    while step < cfg.train.steps:
      state, out = task.train_step(state, step + 1)
      step += 1
      preempt.ready = True  # from here a signal saves this step instead of ending the run at once
      if pending is not None:
        final = flush(*pending)
      pending = (step, out)
      if not task.defer_metrics:
        final, pending = flush(*pending), None
      saved = bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
      if saved and step < cfg.train.steps:
        save(step)
      if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
        evaluate_now(step, s.full(state.params))
      if task.stop_reason and step < cfg.train.steps:  # the objective's own alarm (e.g. kl.max)
        if not saved:
          save(step)
        writer.print(f"stopping at step {step}: {task.stop_reason}; checkpoint saved")
        stopped = True
        break
      if preempt.should_stop(step) and step < cfg.train.steps:
        if pending is not None:
          final, pending = flush(*pending), None
        preempt.stop(step, lambda: save(step), ckpt, writer, saved_already=saved)
    if pending is not None:
      final = flush(*pending)
    if not stopped and (start < cfg.train.steps or latest is None):
      save(cfg.train.steps)
    final.update(evaluate_now(cfg.train.steps, s.full(state.params), last=True))
    ckpt.close()
    if cfg.checkpoint.export_hf:  # every process gathers the weights; process 0 writes
      out_dir = os.path.join(cfg.run_dir, "hf")
      task.export(nnx.merge(s.graphdef, s.full(state.params)), out_dir, s.tok)
      writer.print(f"exported HF checkpoint to {out_dir}")
  writer.close()
  return final
