"""What a task is to the shared loop (`jalign.train.loop`): `Task`, whose hooks each task overrides, the `Setup`
built before the first step, one step's `StepOut`, and the data path the default hooks use (the model, the
pipeline, host batches onto the mesh, the held-out loss)."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jalign import models, parallel
from jalign.config import RunConfig
from jalign.data import pipeline
from jalign.data.scan import scan
from jalign.data.sources import open_source
from jalign.kernels.target import DATA_AXES
from jalign.models import lora
from jalign.objectives import router
from jalign.parallel.distributed import say
from jalign.tokenizers import tokenizer as tokenizer_lib
from jalign.train import optimizer as optim_lib
from jalign.train.metrics import MetricsWriter
from jalign.train.step import Trainable, TrainState, jit_step


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
  preference objectives override the data, model and reference hooks; RL objectives (jalign.tasks.grpo) override
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
    self.jitted = self.jit_update(setup.mesh, setup.trainable(), optimizer, schedule)
    if cfg.data.eval:
      self.eval_loss = _make_eval_loss(cfg, setup, self, encode_fn, self.batch_sharding)
    return self.iterator

  def begin(self, state: TrainState, start: int) -> None:
    """Called once before the first step (at step `start`), inside the mesh."""

  def train_step(self, state: TrainState, step: int) -> tuple[TrainState, StepOut]:
    """Step number `step` (from 1): the next batch through the jitted step."""
    s = self.setup
    local = self.next_batch(state, step)
    records = pipeline.records_of(local)
    tokens = int(np.sum(local["segment_ids"] != 0)) * jax.process_count()
    batch = self.prepare(s.full(state.params), self.global_batch(local, self.batch_sharding))
    state, metrics = self.jitted(state, batch, self.step_frozen())
    self.after_step(step, s.full(state.params))
    metrics = {**metrics, "data/skipped_bad_records": self.counters.bad,
               "data/skipped_too_long": self.counters.too_long}
    return state, StepOut(metrics, tokens, records)

  def router_loss(self) -> router.RouterLoss:
    """An MoE model's router-loss coefficients for this task (`model.router_aux_loss`, `model.router_z_loss`)."""
    return router.RouterLoss(self.cfg.model.router_aux_loss, self.cfg.model.router_z_loss)

  def next_batch(self, state: TrainState, step: int) -> dict:
    """The process-local host batch of step `step` (e.g. with completions the policy samples first)."""
    return next(self.iterator)

  def step_frozen(self):
    """The train step's `frozen` argument (`train.step.make_step`): LoRA's base weights, or None."""
    return self.setup.frozen

  def loss_params(self, params):
    """What the loss function takes as its parameters, from the model's whole parameter dict (outside the train
    step, which builds it from the trainable and the frozen parts)."""
    return params

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

  # --- the step, as the run and the fit check (`jalign.fit`) build it ---

  def make_loss_fn(self, graphdef) -> Callable:
    """loss_fn(params, batch) -> (loss_sum, weight, metric_sums), as `train.step` expects."""
    raise NotImplementedError

  def micro_batches(self) -> int:
    return self.cfg.train.micro_batches

  def update_optimizer(self):
    """(optimizer, learning-rate schedule) of the update."""
    return optim_lib.make(self.cfg.optim, self.cfg.train.steps)

  def jit_update(self, mesh, t: Trainable, optimizer, schedule, **loss_kwargs):
    """The jitted update (state, batch, frozen) -> (state, metrics) of this task's loss (`train.step.jit_step`)."""
    return jit_step(self.make_loss_fn(t.graphdef, **loss_kwargs), optimizer, schedule, self.micro_batches(), mesh, t,
                    dropout_seed=dropout_seed(self.cfg))

  def largest_example(self) -> dict:
    """An encoded example as long as the run takes them (data.max_length), for `abstract_batch`."""
    n = self.cfg.data.max_length
    return {"tokens": np.zeros(n, np.int32), "loss_mask": np.ones(n, np.int32), "record": np.ones(n, np.int32)}

  def abstract_batch(self, model_cfg=None) -> dict:
    """Shapes and dtypes of the global batch of one update: train.batch_size of `largest_example` through the
    run's own batch function (packed rows have the columns and shape of a bucket of train.seq_len). `model_cfg`:
    the model's, for tasks whose batch depends on it."""
    d = self.cfg.data
    examples = [self.largest_example() for _ in range(self.cfg.train.batch_size)]
    buckets = (self.cfg.train.seq_len,) if d.packing else tuple(sorted(d.buckets)) or (self.cfg.train.seq_len,)
    batch = (self.batch_fn or pipeline.bucket_batch(buckets))(examples)
    return {k: jax.ShapeDtypeStruct(np.shape(v), jax.dtypes.canonicalize_dtype(np.asarray(v).dtype))
            for k, v in batch.items() if k != "record"}

  # --- the data path's hooks ---

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


def global_from_full(full, sharding):
  """Device arrays of a batch (a dict of columns, or a pytree such as `rl.batch.RolloutBatch`) that every process
  holds whole (rollouts: each process generates, gathers and scores the same rows); each process places only its
  own shards. A dict's `record` column (the records' file:line) stays on the host."""
  if isinstance(full, dict):
    full = {k: v for k, v in full.items() if k != "record"}
  return jax.tree.map(lambda v: jax.make_array_from_callback(np.shape(v), sharding, lambda idx: np.asarray(v)[idx]),
                      full)


def dropout_seed(cfg: RunConfig) -> int | None:
  """The seed of LoRA dropout masks in the train step; None when nothing drops out."""
  return cfg.seed if cfg.model.lora.rank and cfg.model.lora.dropout > 0 else None


def _make_eval_loss(cfg: RunConfig, s: Setup, task: Task, encode_fn, batch_sharding):
  """Held-out loss and the objective's metrics (eval/<name>), weighted like the training loss."""
  loss_fn = task.make_loss_fn(s.graphdef)
  sums_fn = jax.jit(loss_fn)
  dp_local = max(1, math.prod(s.mesh.shape[a] for a in DATA_AXES) // jax.process_count())

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
      batch = task.prepare(params, task.global_batch(local, batch_sharding))
      l, w, m = jax.device_get(sums_fn(task.loss_params(params), batch))
      total, weight = total + float(l), weight + float(w)
      for k, v in m.items():
        sums[k] = sums.get(k, 0.0) + float(v)
    if not weight:
      return {}
    out = {"eval/loss": total / weight}
    out.update({"eval/" + k: v / weight for k, v in sums.items()})
    return out

  return evaluate
