"""Orbax checkpoints of train state + data-iterator state + config; resume from the newest complete one.

Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoints intact and the incomplete one invisible to `latest_step`.
"""
from __future__ import annotations

import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                       "config": ocp.JsonCheckpointHandler(), "extra": ocp.StandardCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_iterator, config: dict, extra: Any = None) -> None:
    """`extra`: an objective's own state (e.g. a synced reference model), saved beside the train state."""
    items = dict(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator),
                 config=ocp.args.JsonSave(config))
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(extra)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, data_iterator, abstract_extra: Any = None):
    """Restores onto the shardings in `abstract_state` (jax.ShapeDtypeStruct leaves), whatever mesh saved it.
    Returns the state, or (state, extra) when `abstract_extra` is given."""
    items = dict(state=ocp.args.StandardRestore(abstract_state), data=grain.checkpoint.CheckpointRestore(data_iterator))
    if abstract_extra is not None:
      items["extra"] = ocp.args.StandardRestore(abstract_extra)
    out = self._manager.restore(step, args=ocp.args.Composite(**items))
    return out["state"] if abstract_extra is None else (out["state"], out["extra"])

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_like(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
