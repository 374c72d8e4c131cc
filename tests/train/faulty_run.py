"""`python -m jalign.run` with a fault injected at a chosen point, for crash/resume tests.

Environment:
  KILL_AFTER_SAVE=k    SIGKILL once checkpoint k is complete
  KILL_DURING_SAVE=k   SIGKILL right after checkpoint k is started, before it is finalised
  KILL_AT_BATCH=n      SIGKILL after the n-th training batch is placed on the devices
  KILL_AFTER_S=x       SIGKILL x seconds after the first training batch is placed (anywhere: mid-step, mid-save,
                       during an evaluation or the export)
  KILL_AT_PART=n       SIGKILL when a rollout is about to write buffer part n
  KILL_RUN_DIR=text    limits the checkpoint kills to checkpoint directories containing `text` (a pipeline stage)
  TERM_AT_BATCH=n      SIGTERM (a preemption notice) to itself when the n-th training batch is placed
  SIGNAL_AT_BATCH=S:n  signal S (INT, TERM) to itself when the n-th training batch is placed
  SIGNAL_AGAIN_AFTER_S=x  ... and the same signal again x seconds later
  SLOW_SAVE=k:x        the save of checkpoint k first waits x seconds (a slow file system)
  TIME_FILE=path       writes the seconds from the first training batch to a normal exit there
"""
import atexit
import os
import signal
import threading
import time

from absl import app

from jalign import run
from jalign.rl import buffer
from jalign.tasks import grpo, preference
from jalign.train import checkpoint, task


def _die():
  os.kill(os.getpid(), signal.SIGKILL)


def main():
  env = os.environ.get
  after, during, slow = env("KILL_AFTER_SAVE"), env("KILL_DURING_SAVE"), env("SLOW_SAVE")
  save = checkpoint.Checkpointer.save

  def faulty_save(self, step, *args, **kwargs):
    if slow and step == int(slow.split(":")[0]):
      time.sleep(float(slow.split(":")[1]))
    save(self, step, *args, **kwargs)
    if env("KILL_RUN_DIR", "") not in self.directory:
      return
    if during and step == int(during):
      _die()
    if after and step == int(after):
      self.wait()
      _die()

  checkpoint.Checkpointer.save = faulty_save

  # Batches placed on the devices: by the shared loop, or (rollouts held whole) by GRPO / PPO.
  at_batch, term_at, kill_after, time_file = env("KILL_AT_BATCH"), env("TERM_AT_BATCH"), env("KILL_AFTER_S"), \
      env("TIME_FILE")
  signal_at = env("SIGNAL_AT_BATCH")
  calls = {"n": 0}

  def on_batch():
    calls["n"] += 1
    if calls["n"] == 1:
      first = time.perf_counter()
      if kill_after:
        threading.Timer(float(kill_after), _die).start()
      if time_file:
        atexit.register(lambda: open(time_file, "w").write(str(time.perf_counter() - first)))
    if at_batch and calls["n"] > int(at_batch):
      _die()
    if term_at and calls["n"] == int(term_at):
      os.kill(os.getpid(), signal.SIGTERM)
    if signal_at and calls["n"] == int(signal_at.split(":")[1]):
      signum = getattr(signal, "SIG" + signal_at.split(":")[0])
      os.kill(os.getpid(), signum)
      if env("SIGNAL_AGAIN_AFTER_S"):
        threading.Timer(float(env("SIGNAL_AGAIN_AFTER_S")), os.kill, (os.getpid(), signum)).start()

  def counting(real):
    def wrapped(*args, **kwargs):
      on_batch()
      return real(*args, **kwargs)
    return wrapped

  for module in (task, preference, grpo):  # every module that puts host batches on the devices
    for name in ("global_batch", "global_from_full"):
      if hasattr(module, name):
        setattr(module, name, counting(getattr(module, name)))
  at_part = env("KILL_AT_PART")
  if at_part:
    write = buffer.BufferWriter.write

    def faulty_write(self, part, records):
      if part == int(at_part):
        _die()
      return write(self, part, records)

    buffer.BufferWriter.write = faulty_write
  app.run(run.main)


if __name__ == "__main__":
  main()
