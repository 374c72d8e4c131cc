"""The training loop shared by every objective: model and data on the mesh, jitted step, checkpoints, metrics.

Step N+1 is dispatched before step N's metrics are read back, so the host never waits on the device just to log.
SIGTERM (how Cloud TPU spot VMs and Kubernetes preempt) or Ctrl-C finishes the current step, saves it and stops with
`preemption.Preempted` (exit status 143 or 130); see jalign/train/preemption.py.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models, parallel, tokenizer as tokenizer_lib
from jalign.config import RunConfig, as_dict
from jalign.models import lora
from jalign.data import pipeline
from jalign.data.scan import scan
from jalign.data.sources import open_source
from jalign.errors import ConfigError
from jalign.parallel.distributed import say
from jalign.train import optimizer as optim_lib
from jalign.train.checkpoint import Checkpointer, abstract_like
from jalign.train.metrics import MetricsWriter, flops_per_token, peak_flops, to_floats
from jalign.train.preemption import Preemption
from jalign.train.step import TrainState, Trainable, jit_step, trainable


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
  rollout_mesh: jax.sharding.Mesh | None = None  # sampling's own devices (`Task.rollout_mesh_shape`), or None

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


@dataclasses.dataclass
class StepOut:
  """What one step hands the loop."""
  metrics: dict                 # device scalars (read back while the next step runs) or floats
  tokens: int = 0               # tokens trained on, for perf/tokens_per_s and MFU (0: not reported)
  records: Sequence = ()        # what the batch was made of, named by `Task.where` when a step goes non-finite


class Task:
  """An objective as the shared loop runs it. The loop owns everything around the steps: resume, checkpoints (the
  train state, the task's iterator and `extra_state`), metrics, the non-finite policy, evaluation at eval_every and
  at the end, preemption and export. The task builds its steps (`build`) and runs one at a time (`train_step`).

  The defaults fit objectives fed by a data pipeline: a causal LM trained on packed or bucketed sequences (SFT);
  preference objectives override the data, model and reference hooks; RL objectives (jalign.train.grpo) override
  `build` and `train_step` to feed their updates from a rollout stage instead."""

  batch_fn: Callable[[list[dict]], dict] | None = None   # examples -> batch; None = packing / buckets
  defer_metrics = True     # device metrics read back a step late, so the host never waits on the device to log
  eval_loss: Callable[[Any], dict] | None = None          # params -> held-out loss metrics (set by `build`)
  log: MetricsWriter | None = None                        # set by the loop before `begin`
  stop_reason = ""         # set by a step to end the run after it (the loop saves a checkpoint first)

  def __init__(self, cfg: RunConfig):
    self.cfg = cfg
    self.tok = None
    self._sources: dict[str, Any] = {}

  def say(self, text: str) -> None:
    """A line for the user, through the run's metrics writer (process 0 only)."""
    if self.log is not None:
      self.log.print(text)
    else:
      print(text, flush=True)

  # --- the loop's hooks ---

  def rollout_mesh_shape(self) -> tuple:
    """A mesh shape for sampling on devices set apart from training (`parallel.split_meshes`); () = none."""
    return ()

  def load_model(self, cfg: RunConfig, mesh) -> nnx.Module:
    """The module whose parameters train; it has `.cfg` (the backbone's ModelConfig)."""
    return load_model(cfg, mesh)

  def start(self, setup: Setup) -> None:
    """Called once after the model is built and before anything else (the initial policy)."""
    self.tok = setup.tok

  def build(self, setup: Setup, optimizer, schedule):
    """Builds what the steps need; returns the checkpointable iterator saved with the train state."""
    cfg = self.cfg
    self.setup = setup
    for spec in filter(None, (cfg.data.train, cfg.data.eval)):
      self.open_source(spec, train=spec == cfg.data.train)  # read once and reported before the first step
    encode_fn = self.encode_fn()
    self.iterator, self.counters, self.source = data_iterator(cfg, cfg.data.train, encode_fn, train=True, task=self)
    self.batch_sharding = parallel.batch_sharding(setup.mesh)
    self.jitted = jit_step(self.make_loss_fn(setup.graphdef), optimizer, schedule, cfg.train.micro_batches,
                           setup.mesh, setup.trainable(), dropout_seed=dropout_seed(cfg))
    if cfg.data.eval:
      self.eval_loss = _make_eval_loss(cfg, setup, self, encode_fn, self.batch_sharding)
    return self.iterator

  def begin(self, state: TrainState, start: int) -> None:
    """Called once before the first step (at step `start`), inside the mesh."""

  def train_step(self, state: TrainState, step: int) -> tuple[TrainState, StepOut]:
    """Step number `step` (from 1): the next batch through the jitted step."""
    s = self.setup
    local = next(self.iterator)
    records = pipeline.records_of(local)
    tokens = int(np.sum(local["segment_ids"] != 0)) * jax.process_count()
    batch = self.prepare(s.full(state.params), self.global_batch(local, self.batch_sharding))
    state, metrics = self.jitted(state, batch, s.frozen)
    self.after_step(step, s.full(state.params))
    metrics = {**metrics, "data/skipped_bad_records": self.counters.bad,
               "data/skipped_too_long": self.counters.too_long}
    return state, StepOut(metrics, tokens, records)

  def where(self, records: Sequence) -> list[str]:
    """File:line (or the like) of a step's records."""
    return [self.source.where(i) for i in records]

  def evaluate(self, setup: Setup, params) -> dict:
    """Held-out metrics beyond the eval loss, at eval_every and at the end."""
    return {}

  def eval_message(self, step: int, metrics: dict, final: bool) -> str:
    return f"step {step}: " + "  ".join(f"{k}={v:.4f}" for k, v in metrics.items())

  def extra_state(self):
    """A pytree checkpointed with the train state (None = nothing)."""
    return None

  def load_extra_state(self, tree) -> None:
    pass

  def host_state(self):
    """JSON-able host-side state checkpointed with the train state (None = nothing)."""
    return None

  def load_host_state(self, obj) -> None:
    pass

  def export(self, module: nnx.Module, out_dir: str, tok) -> None:
    models.save_pretrained(module, out_dir, tokenizer=tok)

  # --- the data path's hooks ---

  def make_loss_fn(self, graphdef) -> Callable:
    """loss_fn(params, batch) -> (loss_sum, weight, metric_sums), as `train.step` expects."""
    raise NotImplementedError

  def encode(self, record: dict, *, tok, max_length: int, truncation: str) -> dict:
    raise NotImplementedError

  def encode_fn(self) -> Callable[[dict], dict]:
    """`encode` with the run's tokenizer and length settings."""
    d = self.cfg.data
    return functools.partial(self.encode, tok=self.tok, max_length=d.max_length, truncation=d.truncation)

  def open_source(self, spec: str, *, train: bool):
    """The source of `spec`, opened and read once (`check`) on first use, then wrapped (`wrap_source`)."""
    if spec not in self._sources:
      source = open_source(spec, self.cfg.data.fields())
      self.check(spec, source)
      self._sources[spec] = self.wrap_source(spec, source)
    return self._sources[spec]

  def check(self, spec: str, source) -> None:
    """Reads (the first data.check_records of) a source once and says what a run keeps and drops, and why; a
    source that keeps nothing is a DataError here, before the first step."""
    d = self.cfg.data
    tally = scan(source, self.encode_fn(), limit=d.check_records, skip_bad_records=d.skip_bad_records)
    say(f"data {spec}: {tally.summary()}")

  def wrap_source(self, spec: str, source):
    """The source the pipeline reads, from the checked one (e.g. with precomputed columns added)."""
    return source

  def global_batch(self, local: dict, sharding) -> dict:
    """A process-local host batch -> the global device batch (every process's local batch has the same shapes)."""
    return global_batch(local, sharding)

  def prepare(self, params, batch: dict) -> dict:
    """Device batch -> device batch, before every train and eval step (e.g. reference log-probs)."""
    return batch

  def after_step(self, step: int, params) -> None:
    """Called after each optimizer step with the new params (e.g. a reference-model sync)."""


def load_model(cfg: RunConfig, mesh) -> models.Decoder:
  m = cfg.model
  knobs = m.knobs()
  if m.path:
    return models.from_pretrained(m.path, dtype=m.dtype, mesh=mesh, rules=cfg.mesh.rules,
                                  compute_dtype=m.compute_dtype or m.dtype, **knobs)
  arch = m.arch.replace(param_dtype=m.dtype, dtype=m.compute_dtype or m.dtype, **knobs)
  return models.create(arch, seed=cfg.seed, mesh=mesh, rules=cfg.mesh.rules)


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


def data_iterator(cfg: RunConfig, spec: str, encode: Callable, *, train: bool, task: Task | None = None):
  source = task.open_source(spec, train=train) if task else open_source(spec, cfg.data.fields())
  rows = cfg.train.batch_size // jax.process_count()
  pspec = pipeline.PipelineSpec(batch_size=rows, seq_len=cfg.train.seq_len, packing=cfg.data.packing,
                                buckets=cfg.data.buckets, shuffle=cfg.data.shuffle and train, seed=cfg.seed,
                                num_epochs=None if train else 1, skip_bad_records=cfg.data.skip_bad_records,
                                num_packing_bins=cfg.data.num_packing_bins, drop_remainder=train,
                                group_by_length=cfg.data.group_by_length if train else 0,
                                read_threads=cfg.data.read_threads)
  ds, counters = pipeline.build(source, encode, pspec, process_index=jax.process_index(),
                                process_count=jax.process_count(), batch_fn=task.batch_fn if task else None)
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
      if task.stop_reason and step < cfg.train.steps:  # the objective's own alarm (e.g. grpo.max_kl)
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
