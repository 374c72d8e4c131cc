"""The training loop shared by every objective: model and data on the mesh, jitted step, checkpoints, metrics.

Step N+1 is dispatched before step N's metrics are read back, so the host never waits on the device just to log.
SIGTERM (how Cloud TPU spot VMs and Kubernetes preempt) finishes the current step, saves it and stops with
`preemption.Preempted` (exit status 143); see jalign/train/preemption.py.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models, parallel, tokenizer as tokenizer_lib
from jalign.config import RunConfig, as_dict
from jalign.models import lora
from jalign.data import pipeline
from jalign.data.sources import open_source
from jalign.errors import ConfigError
from jalign.train import optimizer as optim_lib
from jalign.train.checkpoint import Checkpointer, abstract_like
from jalign.train.metrics import MetricsWriter, flops_per_token, peak_flops, to_floats
from jalign.train.preemption import Preemption
from jalign.train.step import TrainState, make_step


@dataclasses.dataclass
class Setup:
  """Everything a run builds before its first step."""
  cfg: RunConfig
  mesh: jax.sharding.Mesh
  tok: tokenizer_lib.Tokenizer
  graphdef: Any
  model_cfg: models.ModelConfig
  state: TrainState
  state_shardings: Any
  frozen: Any = None             # with LoRA: the base weights, beside the trainable `state.params`; never donated
  frozen_shardings: Any = None

  def trainable(self) -> "Trainable":
    return Trainable(self.graphdef, self.state, self.state_shardings, self.frozen, self.frozen_shardings)

  def full(self, params):
    """The model's whole parameter dict from the trainable part (no copy)."""
    return lora.combine(params, self.frozen)

  def reference(self):
    """The frozen reference of DPO / GRPO / PPO: the policy as loaded (a copy), or with LoRA the base with adapters
    off (its weights shared, not copied); in pinned host memory with model.offload_reference."""
    if self.frozen is not None:
      return lora.disabled(self.full(self.state.params))
    reference = jax.tree.map(jnp.copy, self.state.params)
    return parallel.in_memory(reference, "pinned_host") if self.cfg.model.offload_reference else reference


class Task:
  """What an objective plugs into the shared loop. The defaults fit a causal LM trained on packed or bucketed
  sequences (SFT); preference objectives override the data, model and reference hooks."""

  batch_fn: Callable[[list[dict]], dict] | None = None   # examples -> batch; None = packing / buckets

  def __init__(self, cfg: RunConfig):
    self.cfg = cfg

  def load_model(self, cfg: RunConfig, mesh) -> nnx.Module:
    """The module whose parameters train; it has `.cfg` (the backbone's ModelConfig)."""
    return load_model(cfg, mesh)

  def make_loss_fn(self, graphdef) -> Callable:
    """loss_fn(params, batch) -> (loss_sum, weight, metric_sums), as `train.step` expects."""
    raise NotImplementedError

  def encode(self, record: dict, *, tok, max_length: int, truncation: str) -> dict:
    raise NotImplementedError

  def open_source(self, spec: str, *, train: bool):
    return open_source(spec, self.cfg.data.fields())

  def start(self, setup: Setup) -> None:
    """Called once after the model is built and before any checkpoint is restored (the initial policy)."""

  def global_batch(self, local: dict, sharding) -> dict:
    """A process-local host batch -> the global device batch (every process's local batch has the same shapes)."""
    return global_batch(local, sharding)

  def prepare(self, params, batch: dict) -> dict:
    """Device batch -> device batch, before every train and eval step (e.g. reference log-probs)."""
    return batch

  def after_step(self, step: int, params) -> None:
    """Called after each optimizer step with the new params (e.g. a reference-model sync)."""

  def extra_state(self):
    """A pytree checkpointed with the train state (None = nothing)."""
    return None

  def load_extra_state(self, tree) -> None:
    pass

  def evaluate(self, setup: Setup, params) -> dict:
    """Held-out metrics beyond the eval loss, at eval_every and at the end."""
    return {}

  def export(self, module: nnx.Module, out_dir: str, tok) -> None:
    models.save_pretrained(module, out_dir, tokenizer=tok)


def load_model(cfg: RunConfig, mesh) -> models.Decoder:
  m = cfg.model
  knobs = m.knobs()
  if m.path:
    return models.from_pretrained(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                  compute_dtype=m.compute_dtype or m.dtype, **knobs)
  arch = m.arch.replace(param_dtype=m.dtype, dtype=m.compute_dtype or m.dtype, **knobs)
  return models.create(arch, seed=cfg.seed, mesh=mesh, rules=cfg.mesh.rules)


@dataclasses.dataclass
class Trainable:
  """A module split for training on a mesh: what `jit_step` and the checkpointer need."""
  graphdef: Any
  state: TrainState
  state_shardings: Any
  frozen: Any = None             # with LoRA adapters: the base weights, beside the trainable `state.params`
  frozen_shardings: Any = None


def trainable(module: nnx.Module, optimizer, mesh, rules) -> Trainable:
  """The one train-state builder (policy, reward model and critic): parameters placed by the logical-axis `rules`
  (parts built outside a loader, such as heads, land on the mesh too), the base weights set apart as frozen when the
  module has LoRA adapters, the optimizer state initialised in its own shardings."""
  graphdef, params = nnx.split(module)
  params = nnx.to_pure_dict(params)
  param_shardings = nnx.to_pure_dict(models.state_shardings(module, mesh, rules))
  params = jax.device_put(params, param_shardings)
  frozen = frozen_shardings = None
  if lora.has_adapters(params):  # only the adapters (and a head) train; the base rides along, frozen
    params, frozen = lora.partition(params)
    param_shardings, frozen_shardings = lora.partition(param_shardings)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  opt_shardings = parallel.optimizer_shardings(optimizer, param_shardings, abstract, mesh)
  opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
  rep = parallel.replicated(mesh)
  return Trainable(graphdef, TrainState.begin(params, opt_state, rep),
                   TrainState(rep, param_shardings, opt_shardings, rep), frozen, frozen_shardings)


def jit_step(loss_fn, optimizer, schedule, micro_batches: int, mesh, t: Trainable, *, dropout_seed=None):
  """The one jitted train step: (state, batch, frozen) -> (state, metrics), the state donated."""
  step_fn = make_step(loss_fn, optimizer, schedule, micro_batches,
                      parallel.batch_sharding(mesh, leading_micro_axis=True), dropout_seed=dropout_seed)
  return jax.jit(step_fn, in_shardings=(t.state_shardings, parallel.batch_sharding(mesh), t.frozen_shardings),
                 out_shardings=(t.state_shardings, parallel.replicated(mesh)), donate_argnums=0)


def setup(cfg: RunConfig, optimizer, task: Task | None = None) -> Setup:
  mesh = parallel.mesh_from_config(cfg.mesh.shape)
  tok = tokenizer_lib.load(cfg.tokenizer or cfg.model.path)
  lm = (task or Task(cfg)).load_model(cfg, mesh)
  if cfg.model.lora.rank:
    lora.add_adapters(getattr(lm, "backbone", lm), cfg.model.lora, seed=cfg.seed)
  if tok.vocab_size > lm.cfg.vocab_size:
    raise ConfigError(f"tokenizer {cfg.tokenizer or cfg.model.path} has {tok.vocab_size} tokens, more than the "
                     f"model's vocab_size {lm.cfg.vocab_size}")
  t = trainable(lm, optimizer, mesh, cfg.mesh.rules)
  return Setup(cfg, mesh, tok, t.graphdef, lm.cfg, t.state, t.state_shardings, t.frozen, t.frozen_shardings)


def data_iterator(cfg: RunConfig, spec: str, encode: Callable, *, train: bool, task: Task | None = None):
  task = task or Task(cfg)
  source = task.open_source(spec, train=train)
  rows = cfg.train.batch_size // jax.process_count()
  pspec = pipeline.PipelineSpec(batch_size=rows, seq_len=cfg.train.seq_len, packing=cfg.data.packing,
                                buckets=cfg.data.buckets, shuffle=cfg.data.shuffle and train, seed=cfg.seed,
                                num_epochs=None if train else 1, skip_bad_records=cfg.data.skip_bad_records,
                                num_packing_bins=cfg.data.num_packing_bins, drop_remainder=train,
                                read_threads=cfg.data.read_threads)
  ds, counters = pipeline.build(source, encode, pspec, process_index=jax.process_index(),
                                process_count=jax.process_count(), batch_fn=task.batch_fn)
  return iter(ds), counters, source


def global_batch(local: dict, sharding) -> dict:
  """Device arrays of a process-local batch; the host-only `record` provenance stays behind."""
  return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local.items()
          if k != "record"}


def global_from_full(full: dict, sharding) -> dict:
  """Device arrays of a batch that every process holds whole (rollouts: each process generates, gathers and scores
  the same rows); each process places only its own shards."""
  return {k: jax.make_array_from_callback(np.shape(v), sharding, lambda idx, v=v: np.asarray(v)[idx])
          for k, v in full.items() if k != "record"}


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
  mesh = s.mesh
  encode_fn = functools.partial(task.encode, tok=s.tok, max_length=cfg.data.max_length,
                                truncation=cfg.data.truncation)
  task.start(s)
  train_it, counters, source = data_iterator(cfg, cfg.data.train, encode_fn, train=True, task=task)

  batch_sharding = parallel.batch_sharding(mesh)
  jitted = jit_step(task.make_loss_fn(s.graphdef), optimizer, lr_schedule, cfg.train.micro_batches, mesh,
                    s.trainable(), dropout_seed=dropout_seed(cfg))

  ckpt = Checkpointer(os.path.join(cfg.run_dir, "checkpoints"), keep=cfg.checkpoint.keep,
                      async_save=cfg.checkpoint.async_save)
  state = s.state
  start = 0
  latest = ckpt.latest_intact_step() if cfg.checkpoint.resume else None
  if latest is not None:
    extra = task.extra_state()
    if extra is None:
      state = ckpt.restore(latest, abstract_like(state), train_it)
    else:
      state, extra = ckpt.restore(latest, abstract_like(state), train_it, abstract_extra=abstract_like(extra))
      task.load_extra_state(extra)
    start = latest
  config_dict = as_dict(cfg)
  writer = MetricsWriter(cfg.log, cfg.run_dir, cfg.train.steps, start, config_dict)
  if latest is not None:
    writer.print(f"resumed from {ckpt.directory}/{latest}")

  loss_eval = _make_eval_loss(cfg, s, task, encode_fn, batch_sharding) if cfg.data.eval else None
  fpt = flops_per_token(s.model_cfg, cfg.train.seq_len)
  peak = peak_flops(cfg.log.peak_flops)
  final: dict[str, float] = {}
  pending = None  # (step, metrics on device, tokens) of the previous step
  last_time = time.perf_counter()

  def evaluate_now(step: int, params) -> dict:
    out = {}
    if loss_eval is not None:
      out.update(loss_eval(params))
    out.update(task.evaluate(s, params))
    if out:
      writer.write(step, out)
      writer.print(f"step {step}: " + "  ".join(f"{k}={v:.4f}" for k, v in out.items()))
    return out

  def save(step: int):
    ckpt.save(step, state, train_it, config_dict, extra=task.extra_state())

  def flush(pending):
    nonlocal last_time
    step, dev_metrics, tokens, records = pending
    m = to_floats(dev_metrics)
    if m.get("train/nonfinite", 0.0) > 0:
      if cfg.train.nonfinite == "stop":
        ckpt.wait()
        names = [source.where(i) for i in records]
        raise NonFiniteError(nonfinite_message(step, m, names, ckpt.directory, ckpt.latest_step()))
      writer.print(f"step {step}: non-finite loss or gradient; update skipped "
                   f"({int(m['train/skipped_nonfinite'])} so far)")
    now = time.perf_counter()
    elapsed, last_time = now - last_time, now
    m["perf/tokens_per_s"] = tokens / max(elapsed, 1e-9)
    m["perf/step_time_s"] = elapsed
    if peak:
      m["perf/mfu"] = m["perf/tokens_per_s"] * fpt / (peak * jax.device_count())
    m["data/skipped_bad_records"] = counters.bad
    m["data/skipped_too_long"] = counters.too_long
    if step % cfg.train.log_every == 0 or step == cfg.train.steps:
      writer.write(step, m)
    writer.advance()
    return m

  with Preemption(cfg.checkpoint.preempt_grace_s, ckpt.newest_complete) as preempt, jax.set_mesh(mesh):
    step = start
    while step < cfg.train.steps:
      local = next(train_it)
      records = pipeline.records_of(local)
      tokens = int(np.sum(local["segment_ids"] != 0)) * jax.process_count()
      batch = task.prepare(s.full(state.params), task.global_batch(local, batch_sharding))
      state, dev_metrics = jitted(state, batch, s.frozen)
      step += 1
      task.after_step(step, s.full(state.params))
      if pending is not None:
        final = flush(pending)
      pending = (step, dev_metrics, tokens, records)
      if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
        save(step)
      if cfg.train.eval_every and step % cfg.train.eval_every == 0 and step < cfg.train.steps:
        evaluate_now(step, s.full(state.params))
      if preempt.should_stop(step) and step < cfg.train.steps:
        flush(pending)
        preempt.stop(step, lambda: save(step), ckpt, writer,
                     saved_already=bool(cfg.checkpoint.every and step % cfg.checkpoint.every == 0))
    if pending is not None:
      final = flush(pending)
    if start < cfg.train.steps or latest is None:
      save(cfg.train.steps)
    final.update(evaluate_now(cfg.train.steps, s.full(state.params)))
    ckpt.close()
    if cfg.checkpoint.export_hf:  # every process gathers the weights; process 0 writes
      out = os.path.join(cfg.run_dir, "hf")
      task.export(nnx.merge(s.graphdef, s.full(state.params)), out, s.tok)
      writer.print(f"exported HF checkpoint to {out}")
  writer.close()
  return final


def dropout_seed(cfg: RunConfig) -> int | None:
  """The seed of LoRA dropout masks in the train step; None when nothing drops out."""
  return cfg.seed if cfg.model.lora.rank and cfg.model.lora.dropout > 0 else None


def _make_eval_loss(cfg: RunConfig, s: Setup, task: Task, encode_fn, batch_sharding):
  """Held-out loss and the objective's metrics (eval/<name>), weighted like the training loss."""
  loss_fn = task.make_loss_fn(s.graphdef)
  sums_fn = jax.jit(loss_fn)
  dp_local = max(1, s.mesh.shape["data"] * s.mesh.shape["fsdp"] // jax.process_count())

  def evaluate(params) -> dict:
    it, _, _ = data_iterator(cfg, cfg.data.eval, encode_fn, train=False, task=task)
    total, weight, sums = 0.0, 0.0, {}
    rows = None
    for _ in range(cfg.train.eval_batches):
      try:
        local = next(it)
      except StopIteration:
        break
      rows = rows or len(local["tokens"])
      if len(local["tokens"]) != rows or rows % dp_local:
        break  # a short final batch would not split over the mesh
      l, w, m = jax.device_get(sums_fn(params, task.prepare(params, task.global_batch(local, batch_sharding))))
      total, weight = total + float(l), weight + float(w)
      for k, v in m.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    if not weight:
      return {}
    out = {"eval/loss": total / weight}
    out.update({"eval/" + k: v / weight for k, v in sums.items()})
    return out

  return evaluate
