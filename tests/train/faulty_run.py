"""`python -m jalign.run` with a SIGKILL injected at a chosen point, for crash/resume tests.

Environment: KILL_AFTER_SAVE=k (once checkpoint k is complete), KILL_DURING_SAVE=k (right after checkpoint k is
started, before it is finalised), KILL_AT_BATCH=n (after the n-th training batch is dispatched), KILL_AT_PART=n
(when a rollout is about to write buffer part n). KILL_RUN_DIR=text limits the checkpoint kills to checkpoint
directories containing `text` (one stage of a pipeline).
"""
import os
import signal

from absl import app

from jalign import run
from jalign.rl import buffer
from jalign.train import checkpoint, loop


def _die():
  os.kill(os.getpid(), signal.SIGKILL)


def main():
  after, during = os.environ.get("KILL_AFTER_SAVE"), os.environ.get("KILL_DURING_SAVE")
  at_batch = os.environ.get("KILL_AT_BATCH")
  save = checkpoint.Checkpointer.save

  def faulty_save(self, step, *args, **kwargs):
    save(self, step, *args, **kwargs)
    if os.environ.get("KILL_RUN_DIR", "") not in self.directory:
      return
    if during and step == int(during):
      _die()
    if after and step == int(after):
      self.wait()
      _die()

  checkpoint.Checkpointer.save = faulty_save
  if at_batch:  # batches placed on the devices: by the shared loop, or (rollouts held whole) by GRPO / PPO
    calls = {"n": 0}

    def counting(real):
      def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > int(at_batch):
          _die()
        return real(*args, **kwargs)
      return wrapped

    loop.global_batch = counting(loop.global_batch)
    loop.global_from_full = counting(loop.global_from_full)
  at_part = os.environ.get("KILL_AT_PART")
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
