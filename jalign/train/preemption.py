"""SIGTERM -> checkpoint -> exit 143: how a run survives preemption.

Cloud TPU spot VMs, GCE maintenance events and Kubernetes all send SIGTERM and then SIGKILL after a grace period
(30 s by default on each). A loop asks `should_stop(step)` after every step; once it is true the loop saves that step,
calls `saved()` and raises `Preempted`, which `jalign.run` turns into exit status 143 (128 + SIGTERM) so a
supervisor (tpu_scripts/launch.sh --restart, a Kubernetes Job, SLURM --requeue) knows to start it again; the same
command then resumes from that checkpoint.

One process: a Python SIGTERM handler sets the flag. Several processes (jax.distributed): JAX's own preemption
service holds the SIGTERM handler on every host, spreads the notice and picks one step at which all hosts stop
(`reached_preemption_sync_point`), so every process saves the same step.

`checkpoint.preempt_grace_s`: if the checkpoint is not written that many seconds after the notice, the process
says so and exits (143) itself instead of being killed silently mid-write; the resume then picks the newest complete
checkpoint, as after any crash.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, NoReturn

import jax
from jax.experimental import multihost_utils

EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
  """A loop saved its state on SIGTERM and stopped; rerunning the same command resumes."""


class Preemption:
  """Context manager; `latest` names the newest complete checkpoint for the grace-period message."""

  def __init__(self, grace_s: float, latest: Callable[[], str]):
    self.grace_s = grace_s
    self._latest = latest
    self._requested = False
    self._previous = None
    self._timer: threading.Timer | None = None
    self._multi = jax.process_count() > 1

  def __enter__(self):
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def __exit__(self, *exc):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
    self.saved()

  def _handle(self, signum, frame):
    if not self._requested:
      self._requested = True
      self._start_clock()

  def _start_clock(self):
    if self.grace_s > 0 and self._timer is None:
      self._timer = threading.Timer(self.grace_s, self._late)
      self._timer.daemon = True
      self._timer.start()

  def _late(self):
    print(f"SIGTERM: checkpoint.preempt_grace_s={self.grace_s:g} s ran out before the checkpoint was written; "
          f"exiting with status {EXIT_CODE}. The newest complete checkpoint is {self._latest()}; rerun the same "
          "command to resume from it", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)

  def should_stop(self, step: int) -> bool:
    """True at the step where this process (all processes, under jax.distributed) must save and stop."""
    if self._multi:
      if not self._requested and multihost_utils.reached_preemption_sync_point(step):
        self._requested = True
        self._start_clock()
      return self._requested
    return self._requested

  def stop(self, step: int, save: Callable[[], None], ckpt, writer, saved_already: bool) -> NoReturn:
    """Saves `step` (unless the regular schedule just did), closes the checkpointer and the metrics writer, and
    raises Preempted."""
    if not saved_already:
      save()
    ckpt.close()
    self.saved()
    writer.print(f"SIGTERM: saved step {step} to {ckpt.directory}; exiting")
    writer.close()
    raise Preempted(f"saved step {step} to {ckpt.directory}")

  def saved(self):
    """The checkpoint is written: the grace clock stops."""
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None
