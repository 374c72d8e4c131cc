"""Metrics to the console (progress bar with ETA), a JSONL file, TensorBoard and W&B; throughput and MFU."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax

from jalign.config import LogSection
from jalign.core import files
from jalign.models.config import ModelConfig
from jalign.models.sharding import to_host

# Dense bf16 peak FLOP/s per chip, from the vendors' spec sheets.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "TPU v4": 275e12, "TPU v5 lite": 197e12,
              "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12, "TPU v6 lite": 918e12, "TPU v6e": 918e12}

# HBM bandwidth per chip, bytes/s, from the same spec sheets (H100: SXM; A100: 80 GB SXM).
PEAK_HBM = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.039e12, "TPU v4": 1.2e12, "TPU v5 lite": 0.819e12,
            "TPU v5e": 0.819e12, "TPU v5p": 2.765e12, "TPU v5": 2.765e12, "TPU v6 lite": 1.64e12, "TPU v6e": 1.64e12}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 N (forward + backward of every matmul weight, the LM head included, the embedding
  lookup excluded; an MoE model's active parameters: its k experts of E) plus the attention term 12 L H Dh T (PaLM,
  Chowdhery et al. 2022, appendix B), half of it over the query/key heads' size and half over the value heads'
  (an MLA model's differ)."""
  n = cfg.num_params(active=True) - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size)  # a tied table is the head
  return 6.0 * n + 6.0 * cfg.num_layers * cfg.num_heads * (cfg.head_dim + cfg.v_dim) * seq_len


def _by_device_kind(table: dict) -> float | None:
  kind = jax.devices()[0].device_kind.lower()
  return next((value for name, value in table.items() if name.lower() in kind), None)


def peak_flops(configured: float) -> float | None:
  return configured if configured > 0 else _by_device_kind(PEAK_FLOPS)


def peak_hbm_bandwidth() -> float | None:
  return _by_device_kind(PEAK_HBM)


class MetricsWriter:
  def __init__(self, cfg: LogSection, run_dir: str, total_steps: int, start_step: int, config: dict[str, Any]):
    self.cfg = cfg
    self.total = total_steps
    self._main = jax.process_index() == 0
    self._jsonl = self._tb = self._wandb = self._bar = None
    self._start = start_step
    if not self._main:
      return
    os.makedirs(run_dir, exist_ok=True)
    self._samples_path = os.path.join(run_dir, "samples.jsonl")
    _keep_until(self._samples_path, start_step)
    if cfg.jsonl:
      path = os.path.join(run_dir, "metrics.jsonl")
      _keep_until(path, start_step)
      self._jsonl = open(path, "a", encoding="utf-8")
    if cfg.tensorboard:
      try:
        from tensorboardX import SummaryWriter
        self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
      except ImportError:
        print("tensorboardX is not installed: TensorBoard logging is off", file=sys.stderr)
    if cfg.wandb:
      try:
        import wandb
        self._wandb = wandb.init(project=cfg.wandb_project, dir=run_dir, config=config, resume="allow")
      except ImportError:
        print("wandb is not installed: W&B logging is off", file=sys.stderr)
    if cfg.progress:
      from tqdm import tqdm
      self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stdout,
                       disable=None)

  def write(self, step: int, metrics: dict[str, float]) -> None:
    if not self._main:
      return
    clean = {k: float(v) for k, v in metrics.items() if v is not None}
    if self._jsonl:
      self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
      self._jsonl.flush()
    if self._tb:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb:
      self._wandb.log(clean, step=step)
    keys = ("train/loss", "actor/loss", "critic/score/mean", "actor/kl_loss", "train/lr", "perf/tokens_per_s",
            "perf/mfu")
    shown = {k.split("/")[-1]: f"{clean[k]:.4g}" for k in keys if k in clean}
    if self._bar is not None and not self._bar.disable:
      self._bar.set_postfix(shown, refresh=False)
    elif self.cfg.progress and shown:  # not a terminal (a log file, CI): one line per logged step
      print(f"step {step}/{self.total}: " + "  ".join(f"{k}={v}" for k, v in shown.items()), flush=True)

  def wants_samples(self, step: int) -> bool:
    """Whether step `step` shows its sampled completions (the run's first step, then every log.samples_every)."""
    return bool(self.cfg.samples) and (step == self._start + 1 or step % self.cfg.samples_every == 0)

  def samples(self, step: int, rows: list[dict]) -> None:
    """Sampled completions with their rewards ({"prompt", "completion", "reward", ...}): a line each on the console,
    appended to run_dir/samples.jsonl and as TensorBoard text."""
    if not self._main or not rows:
      return
    with open(self._samples_path, "a", encoding="utf-8") as f:
      for r in rows:
        f.write(json.dumps({"step": step, **r}) + "\n")
    for r in rows:
      extra = "".join(f", {k} {v!r:.40}" for k, v in r.items() if k not in ("prompt", "completion", "reward"))
      self.print(f"step {step} sample (reward {r['reward']:.3f}{extra}): {_short(r['prompt'])!r} -> "
                 f"{_short(r['completion'])!r}")
    if self._tb:
      text = "\n\n".join(f"**reward {r['reward']:.3f}**\n\n    {r['prompt']}\n\n    {r['completion']}" for r in rows)
      self._tb.add_text("samples", text, step)

  def advance(self, n: int = 1) -> None:
    if self._bar is not None:
      self._bar.update(n)

  def print(self, text: str) -> None:
    if not self._main:
      return
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    if self._jsonl:
      self._jsonl.close()
    if self._tb:
      self._tb.close()
    if self._wandb:
      self._wandb.finish()


def _short(text: str, keep: int = 160) -> str:
  """The end of a long prompt and the start of a long completion are what a reader checks: keep both ends."""
  return text if len(text) <= keep else text[:keep // 2] + " ... " + text[-keep // 2:]


def _keep_until(path: str, step: int) -> None:
  """Drops the rows of `path` past `step` (the checkpoint a run resumes from, 0 for a fresh start): steps an
  interrupted run logged after its last checkpoint are run again, and logged once."""
  if not os.path.exists(path):
    return
  kept, dropped = [], 0
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:  # a line cut short by a kill mid-write
        dropped += 1
        continue
      if isinstance(row, dict) and isinstance(row.get("step"), (int, float)) and row["step"] <= step:
        kept.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
  if dropped:
    files.write_text(path, "".join(kept))


def to_floats(metrics: dict) -> dict[str, float]:
  """Device scalars -> Python floats (one transfer)."""
  return {k: float(v) for k, v in to_host(metrics).items()}
