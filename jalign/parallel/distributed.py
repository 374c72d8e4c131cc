"""Multi-process start-up: one jalign process per host (or per GPU), joined by `jax.distributed` into one runtime
whose global mesh spans every process's devices. The same program runs on one CPU and on a pod slice.

How a process learns its place, first match wins:
1. `distributed.coordinator_address` (host:port of process 0), `num_processes` and `process_id` in the config;
   or `coordinator_address="auto"`: JAX's own detection of the cluster (what tpu_scripts/launch.sh passes; where
   JAX finds none, e.g. on a plain VM, one process);
2. the environment of a cluster JAX recognises: Cloud TPU pod slices (`TPU_WORKER_HOSTNAMES` lists several
   workers), SLURM (`SLURM_NTASKS` > 1), Open MPI (`OMPI_COMM_WORLD_SIZE` > 1), or `JAX_COORDINATOR_ADDRESS` set
   (with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`: Kubernetes and hand-rolled launchers); JAX's own cluster
   detection fills in the rest;
3. otherwise: a single process, nothing to initialise.

After start-up, every process loads only its share of the data, all write one checkpoint directory (Orbax: each
its own shards), and only process 0 logs and writes files such as the HF export (after all have gathered the
weights, a collective every process joins).
"""
from __future__ import annotations

import dataclasses
import os

import jax

from jalign.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DistributedSection:
  coordinator_address: str = ""        # "host:port" of process 0; "auto" = JAX detects the cluster; "" = from
                                       # the cluster environment when there is one, else a single process
  num_processes: int = 0               # with coordinator_address: how many processes join
  process_id: int = -1                 # with coordinator_address: this process's rank, 0 .. num_processes - 1
  cpu_devices: int = 0                 # CPU runs only: devices per process (tests and laptops); 0 = the default
  timeout_s: int = 300                 # how long to wait for every process to join


def cluster_environment() -> str | None:
  """The multi-process environment this process was started in, if any (see the module doc)."""
  env = os.environ
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return "Cloud TPU pod slice"
  if int(env.get("SLURM_NTASKS", "1") or 1) > 1:
    return "SLURM"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return "Open MPI"
  if env.get("JAX_COORDINATOR_ADDRESS"):
    return "JAX_COORDINATOR_ADDRESS"
  return None


_started = False


def initialize(section: DistributedSection) -> bool:
  """Joins the multi-process runtime when the config or the environment asks for it (before any other JAX call
  touches the devices). Returns whether it did."""
  global _started
  if section.cpu_devices:
    jax.config.update("jax_num_cpu_devices", section.cpu_devices)
  if _started:
    return True
  if section.coordinator_address == "auto":
    try:
      jax.distributed.initialize(initialization_timeout=section.timeout_s)
    except ValueError as e:  # JAX found no cluster (e.g. a plain VM): one process, as a launcher's default allows
      if cluster_environment() is not None:
        raise
      print(f"distributed.coordinator_address=auto: no cluster detected ({e}); running as a single process",
            flush=True)
      return False
  elif section.coordinator_address:
    if section.num_processes < 1 or not 0 <= section.process_id < section.num_processes:
      raise ConfigError(f"distributed.coordinator_address={section.coordinator_address!r} needs num_processes >= 1 "
                       f"and 0 <= process_id < num_processes (got {section.num_processes}, {section.process_id})")
    jax.distributed.initialize(coordinator_address=section.coordinator_address,
                               num_processes=section.num_processes, process_id=section.process_id,
                               initialization_timeout=section.timeout_s)
  elif os.environ.get("JAX_COORDINATOR_ADDRESS") and os.environ.get("JAX_NUM_PROCESSES"):
    jax.distributed.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                               num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ.get("JAX_PROCESS_ID", "0")),
                               initialization_timeout=section.timeout_s)
  elif cluster_environment() is not None:
    jax.distributed.initialize(initialization_timeout=section.timeout_s)
  else:
    return False
  _started = True
  return True


def shutdown() -> None:
  """Leaves the runtime cleanly (every process reaches this point: a barrier, then disconnect)."""
  global _started
  if _started:
    jax.distributed.shutdown()
    _started = False


def is_main() -> bool:
  return jax.process_index() == 0


def say(text: str) -> None:
  """Prints on process 0 only (every process runs the same program and would say the same)."""
  if is_main():
    print(text, flush=True)
