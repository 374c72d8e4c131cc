"""The run directory: created (or a clear error) and locked while a run uses it, so two runs never interleave their
metrics or overwrite each other's checkpoints and exports.

The lock is `<run_dir>/.lock`, a JSON file naming the holder's pid and host, created whole in one step (a hard link
of a finished temporary file, which fails if the lock exists). A lock whose holder is a dead process on this host
(a run killed with SIGKILL, a machine restarted) is taken over with a warning; one held on another host cannot be
checked from here and stays an error that names it.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from jalign.core.errors import ConfigError
from jalign.parallel import distributed
from jalign.train import preemption

LOCK = ".lock"


def _holder(path: str) -> dict | None:
  try:
    with open(path, encoding="utf-8") as f:
      holder = json.load(f)
    return holder if isinstance(holder, dict) else None
  except (OSError, ValueError):
    return None


def _running(holder: dict | None) -> bool:
  """Whether the lock's holder may still be running (True when that cannot be checked: another host)."""
  if holder is None or not isinstance(holder.get("pid"), int):
    return False  # not a lock this module wrote
  if holder.get("host") != socket.gethostname():
    return True
  try:
    os.kill(holder["pid"], 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's live process
    return True
  return True


def _create(run_dir: str, path: str) -> bool:
  """Writes the lock whole; False when one exists."""
  me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv)}
  tmp = f"{path}.{os.getpid()}.tmp"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(me, f)
    os.link(tmp, path)
    return True
  except FileExistsError:
    return False
  except OSError as e:
    raise ConfigError(f"config.run_dir={run_dir!r}: cannot write in it ({e.strerror}); choose a directory you can "
                      "write to") from None
  finally:
    with contextlib.suppress(OSError):
      os.remove(tmp)


@contextlib.contextmanager
def claimed(run_dir: str):
  """Creates `run_dir` and holds its lock while the block runs (process 0 of a multi-process run). ConfigError if the
  directory cannot be created or written, or another running process holds it."""
  if not distributed.is_main():
    yield
    return
  try:
    os.makedirs(run_dir, exist_ok=True)
  except OSError as e:
    raise ConfigError(f"config.run_dir={run_dir!r}: cannot create it ({e.strerror}); choose a directory you can "
                      "write to") from None
  path = os.path.join(run_dir, LOCK)
  while not _create(run_dir, path):
    holder = _holder(path)
    if _running(holder):
      raise ConfigError(
          f"config.run_dir={run_dir!r} is in use by another run: pid {holder['pid']} on host {holder.get('host')}, "
          f"since {holder.get('since')} ({holder.get('command', '')}). Wait for it to finish or stop it, or choose "
          f"another run_dir; if that process is gone, delete {path}")
    what = f"pid {holder.get('pid')} on host {holder.get('host')}" if holder else "an unreadable lock"
    print(f"warning: {path} was left by a run that is no longer running ({what}); taking the run directory over",
          file=sys.stderr, flush=True)
    try:
      os.remove(path)
    except FileNotFoundError:
      pass  # another run took it over first: the next attempt finds its lock
    except OSError as e:
      raise ConfigError(f"config.run_dir={run_dir!r}: cannot remove the stale lock {path} ({e.strerror})") from None

  def release():
    if (_holder(path) or {}).get("pid") == os.getpid():
      with contextlib.suppress(OSError):
        os.remove(path)

  preemption.on_exit.append(release)
  try:
    yield
  finally:
    preemption.on_exit.remove(release)
    release()
