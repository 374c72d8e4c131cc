"""Orbax checkpoints of train state + data-iterator state + config; resume from the newest complete, intact one.

Orbax writes each step into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoints intact and the incomplete one invisible. Once a step is complete, a SHA-256 of each of its files
is written beside them (`checksums.json`); resuming verifies them and passes over a step whose files were truncated
or altered since (naming the file), so damaged bytes are never loaded as weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jalign.core import files
from jalign.core.errors import CheckpointError


class Checkpointer:
  def __init__(self, directory: str, *, keep: int, async_save: bool = True):
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(
        self.directory, options=options,
        item_handlers={"state": ocp.StandardCheckpointHandler(), "data": grain.checkpoint.CheckpointHandler(),
                       "config": ocp.JsonCheckpointHandler(), "extra": ocp.StandardCheckpointHandler(),
                       "host": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def newest_complete(self) -> str:
    """The newest finalised step's directory, read from the file system only (safe from any thread; Orbax renames
    a step's directory to its number once every file is written)."""
    steps = [int(n) for n in os.listdir(self.directory) if n.isdigit()] if os.path.isdir(self.directory) else []
    return os.path.join(self.directory, str(max(steps))) if steps else "none yet"

  def latest_intact_step(self) -> int | None:
    """The newest step whose files match their checksums (or that has none); damaged ones are reported and moved
    aside to `<step>.damaged`."""
    self._manager.wait_until_finished()
    for step in sorted(self._manager.all_steps(), reverse=True):
      problem = verify(os.path.join(self.directory, str(step)))
      if problem is None:
        return step
      aside = os.path.join(self.directory, f"{step}.damaged")
      if jax.process_index() == 0:  # every process finds the same damage; one moves it
        os.replace(os.path.join(self.directory, str(step)), aside)  # out of the way of this step's next save
        print(f"checkpoint {self.directory}/{step} is damaged ({problem}); moved to {aside}, resuming from an "
              "earlier one", file=sys.stderr, flush=True)
      self._manager.reload()
    return None

  def save(self, step: int, state: Any, data_iterator, config: dict, extra: Any = None, host: Any = None) -> None:
    """`extra`: an objective's own state (e.g. a synced reference model), saved beside the train state; `host`: its
    host-side state as JSON (e.g. rollouts sampled for the next steps)."""
    items = dict(state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator),
                 config=ocp.args.JsonSave(config))
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(extra)
    if host is not None:
      items["host"] = ocp.args.JsonSave(host)
    self._seal_finished()
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, abstract_state: Any, data_iterator, abstract_extra: Any = None):
    """Restores onto the shardings in `abstract_state` (jax.ShapeDtypeStruct leaves), whatever mesh and number of
    processes saved it. Returns the state, or (state, extra) when `abstract_extra` is given."""
    items = dict(state=ocp.args.StandardRestore(abstract_state))
    saved_data = self._data_states(step)
    if saved_data is None:  # saved by as many processes as there are now: each resumes its own reader
      items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
    if abstract_extra is not None:
      items["extra"] = ocp.args.StandardRestore(abstract_extra)
    out = self._manager.restore(step, args=ocp.args.Composite(**items))
    if saved_data is not None:
      data_iterator.set_state(remap_data_state(saved_data, data_iterator.get_state()))
    return out["state"] if abstract_extra is None else (out["state"], out["extra"])

  def restore_host(self, step: int) -> Any:
    """The host-side JSON state saved with `step` (None if it has none)."""
    if not os.path.isdir(os.path.join(self.directory, str(step), "host")):
      return None
    return self._manager.restore(step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))["host"]

  def _data_states(self, step: int) -> list[dict] | None:
    """The data-reader states of a step saved by a different number of processes (None when it matches)."""
    directory = os.path.join(self.directory, str(step), "data")
    if os.path.exists(os.path.join(directory, f"process_{jax.process_index()}-of-{jax.process_count()}.json")):
      return None
    names = [n for n in os.listdir(directory) if re.fullmatch(r"process_\d+-of-\d+\.json", n)]
    if not names:
      raise CheckpointError(f"{directory}: no data-reader state (process_*-of-*.json)")
    return [json.load(open(os.path.join(directory, n), encoding="utf-8")) for n in sorted(names)]

  def wait(self) -> None:
    self._seal_finished()

  def close(self) -> None:
    self._seal_finished()
    self._manager.close()

  def _seal_finished(self) -> None:
    """Checksums for every complete step that has none yet (only process 0 writes)."""
    self._manager.wait_until_finished()
    if jax.process_index() != 0:
      return
    for step in self._manager.all_steps():
      directory = os.path.join(self.directory, str(step))
      if os.path.isdir(directory) and not os.path.exists(os.path.join(directory, CHECKSUMS)):
        write_checksums(directory)


def abstract_like(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


CHECKSUMS = "checksums.json"


def _digest(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def _files(directory: str) -> list[str]:
  out = []
  for root, _, names in os.walk(directory):
    out.extend(os.path.relpath(os.path.join(root, n), directory) for n in names)
  return sorted(f for f in out if f != CHECKSUMS)


def write_checksums(directory: str) -> None:
  sums = {f: _digest(os.path.join(directory, f)) for f in _files(directory)}
  files.write_json(os.path.join(directory, CHECKSUMS), sums, indent=0)


def verify(directory: str) -> str | None:
  """None when every file listed in the step's checksums is present and matches (or when it has none: written
  before sealing, e.g. by a run killed right after the save completed); else what is wrong."""
  path = os.path.join(directory, CHECKSUMS)
  if not os.path.exists(path):
    return None
  try:
    sums = json.load(open(path, encoding="utf-8"))
  except (OSError, ValueError) as e:
    return f"{CHECKSUMS} unreadable: {e}"
  for name, digest in sums.items():
    file = os.path.join(directory, name)
    if not os.path.exists(file):
      return f"{name} is missing"
    if _digest(file) != digest:
      return f"{name} does not match its checksum (truncated or altered)"
  return None


def remap_data_state(saved: list[dict], fresh: dict) -> dict:
  """This process's reader state, from the states of the N processes that saved (each read records p, p + N, ...
  of the shared global order): every reader resumes at the global position the slowest saved one had reached,
  so with unpacked batches (equal counts per process) not a record is repeated or skipped. Packing bins
  half-filled at save time are not carried over. Skip counters are summed onto process 0."""
  position = min(_next_index(s) for s in saved) * len(saved)
  state = json.loads(json.dumps(fresh))
  _set_next_index(state, position // jax.process_count())
  for key in ("bad", "too_long"):
    if key in state:
      state[key] = sum(int(s.get(key, 0)) for s in saved) if jax.process_index() == 0 else 0
  return state


def _next_index(state: dict) -> int:
  while "next_index" not in state:
    state = state["parent"]
  return int(state["next_index"])


def _set_next_index(state: dict, value: int) -> None:
  while "next_index" not in state:
    state = state["parent"]
  state["next_index"] = value
