"""SIGTERM or Ctrl-C -> checkpoint -> exit: how a run survives preemption and an interrupt.

Cloud TPU spot VMs, GCE maintenance events and Kubernetes all send SIGTERM and then SIGKILL after a grace period
(30 s by default on each); a user presses Ctrl-C (SIGINT). A loop asks `should_stop(step)` after every step; once it
is true the loop saves that step and raises `Preempted`, which `jalign.run` turns into one line and exit status
128 + the signal (143 for SIGTERM, 130 for SIGINT), so a supervisor (tpu_scripts/launch.sh --restart, a Kubernetes
Job, SLURM --requeue) knows to start it again; the same command then resumes from that checkpoint. A second Ctrl-C
exits at once. A signal before the loop has finished a step of this run (start-up, data checks, the first step's
compilation) has nothing new to save: the process says so and exits at once.

One process: the signals are seen by a watcher thread woken by Python's C-level handler (`signal.set_wakeup_fd`),
so they act at once even while the main thread is inside a long XLA compilation. Several processes
(jax.distributed): JAX's own preemption service holds the SIGTERM handler on every host, spreads the notice and
picks one step at which all hosts stop (`reached_preemption_sync_point`), so every process saves the same step.

`checkpoint.preempt_grace_s`: if the checkpoint is not written that many seconds after the notice, the process
says so and exits itself instead of being killed silently mid-write; the resume then picks the newest complete
checkpoint, as after any crash.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Callable, NoReturn

import jax
from jax.experimental import multihost_utils

EXIT_CODE = 128 + signal.SIGTERM
NAMES = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "Ctrl-C (SIGINT)"}
on_exit: list[Callable[[], None]] = []   # run before an immediate exit (e.g. the run directory's lock released)


class Preempted(Exception):
  """A loop saved its state on a signal and stopped; rerunning the same command resumes."""

  def __init__(self, message: str, code: int = EXIT_CODE):
    super().__init__(message)
    self.code = code


def _exit_now(message: str, code: int) -> NoReturn:
  print(message, file=sys.stderr, flush=True)
  for fn in on_exit:
    fn()
  os._exit(code)


class _Watcher:
  """The process's SIGTERM / SIGINT handling (one process, main thread): each signal goes to the `Preemption` in
  force, or, outside one, ends the process at once."""

  def __init__(self):
    self.target: Preemption | None = None
    self._previous: dict = {}
    self._fds = None

  def install(self) -> bool:
    """Installs the handlers (idempotent); False where they cannot be (not the main thread)."""
    if self._fds is not None:
      return True
    if threading.current_thread() is not threading.main_thread():
      return False
    read, write = socket.socketpair()
    write.setblocking(False)
    self._fds = (read, write)
    for sig in NAMES:  # Python's C handler writes the signal number to `write` at once; ours runs later, a no-op
      self._previous[sig] = signal.signal(sig, lambda *_: None)
    self._old_fd = signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    threading.Thread(target=self._watch, args=(read,), name="signals", daemon=True).start()
    return True

  def uninstall(self) -> None:
    if self._fds is None:
      return
    signal.set_wakeup_fd(self._old_fd)
    for sig, previous in self._previous.items():
      signal.signal(sig, previous)
    self._fds[1].close()  # the watcher's read returns empty and it ends
    self._fds = None

  def _watch(self, read: socket.socket) -> None:
    while True:
      try:
        data = read.recv(64)
      except OSError:
        data = b""
      if not data:  # uninstalled
        read.close()
        return
      for signum in data:
        if signum in NAMES:
          self._handle(signal.Signals(signum))

  def _handle(self, signum: signal.Signals) -> None:
    target, name, code = self.target, NAMES[signum], 128 + signum
    if target is None or not target.ready:
      _exit_now(f"{name} before this run finished a step: nothing new to save; exiting with status {code}"
                + (f". The newest complete checkpoint is {target.latest()}" if target is not None else ""), code)
    if target.requested is not None:
      if signum == signal.SIGINT:
        _exit_now(f"{name} again: exiting now without saving (status {code}); the newest complete checkpoint is "
                  f"{target.latest()}, and rerunning the same command resumes from it", code)
      return
    target.request(signum)


_watcher = _Watcher()


def install() -> None:
  """Signal handling for the whole process (called at start by `jalign.run`, so a signal during start-up exits at
  once with a line instead of a traceback). One process only: several leave SIGTERM to JAX's service, which picks
  the step they all save, and Ctrl-C interrupts them unsaved (each would stop at a step of its own)."""
  if jax.process_count() == 1:
    _watcher.install()
  elif threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGINT, signal.default_int_handler)  # several processes stop together on SIGTERM only


class Preemption:
  """Context manager around a training loop; `latest` names the newest complete checkpoint for the messages. Until
  `ready` (set by the loop once a step of this run has finished) a signal exits at once."""

  def __init__(self, grace_s: float, latest: Callable[[], str]):
    self.grace_s = grace_s
    self.latest = latest
    self.ready = False
    self.requested: signal.Signals | None = None
    self._timer: threading.Timer | None = None
    self._multi = jax.process_count() > 1
    self._installed_here = False

  def __enter__(self):
    if not self._multi:
      self._installed_here = _watcher._fds is None and _watcher.install()
      self._outer, _watcher.target = _watcher.target, self
    return self

  def __exit__(self, *exc):
    if not self._multi:
      _watcher.target = self._outer
      if self._installed_here:
        _watcher.uninstall()
    self.saved()

  def request(self, signum: signal.Signals) -> None:
    self.requested = signum
    self._start_clock()

  def _start_clock(self):
    if self.grace_s > 0 and self._timer is None:
      self._timer = threading.Timer(self.grace_s, self._late)
      self._timer.daemon = True
      self._timer.start()

  def _late(self):
    name = NAMES.get(self.requested, "SIGTERM")
    code = 128 + (self.requested or signal.SIGTERM)
    _exit_now(f"{name}: checkpoint.preempt_grace_s={self.grace_s:g} s ran out before the checkpoint was written; "
              f"exiting with status {code}. The newest complete checkpoint is {self.latest()}; rerun the same "
              "command to resume from it", code)

  def should_stop(self, step: int) -> bool:
    """True at the step where this process (all processes, under jax.distributed) must save and stop."""
    if self._multi and self.requested is None and multihost_utils.reached_preemption_sync_point(step):
      self.request(signal.SIGTERM)
    return self.requested is not None

  def stop(self, step: int, save: Callable[[], None], ckpt, writer, saved_already: bool) -> NoReturn:
    """Saves `step` (unless the regular schedule just did), closes the checkpointer and the metrics writer, and
    raises Preempted with the line `jalign.run` prints."""
    if not saved_already:
      save()
    ckpt.close()
    self.saved()
    writer.close()
    signum = self.requested or signal.SIGTERM
    raise Preempted(f"{NAMES[signum]}: saved step {step} to {ckpt.directory}; exiting with status {128 + signum}; "
                    "rerun the same command to resume", 128 + signum)

  def saved(self):
    """The checkpoint is written: the grace clock stops."""
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None
