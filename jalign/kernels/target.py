"""The platform a kernel is being compiled for, how the current mesh splits rows, static windows."""
from __future__ import annotations

import math

import jax
import numpy as np

# The mesh's axes, in device order (`tensor` innermost, so its collectives stay on the nearest chips, `sequence`
# next, so a ring's hops do too), and the ones that split examples. `expert` is data-parallel outside the MoE layers
# and holds a share of the experts inside them (`kernels.moe`), as MaxText and GShard lay expert parallelism out.
# `sequence` splits each example's tokens (context parallelism, `kernels.context`).
AXIS_NAMES = ("data", "fsdp", "expert", "sequence", "tensor")
DATA_AXES = ("data", "fsdp", "expert")
SEQUENCE_AXIS = "sequence"


def target_platform() -> str:
  """That of the devices of the mesh set by `jax.set_mesh` (a TPU topology's when compiling ahead of time for one
  on another host), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


def sequence_shards() -> int:
  """How many shards the current mesh splits each example's tokens into (its `sequence` axis; 1 without)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get(SEQUENCE_AXIS, 1)


def ring_hop(axis: str, shards: int):
  """A function sending a pytree to the next device round the ring of `axis` (device d receives from d - 1)."""
  ring = [(d, (d + 1) % shards) for d in range(shards)]
  return lambda tree: jax.tree.map(lambda a: jax.lax.ppermute(a, axis, ring), tree)


def static_window(window) -> bool:
  """Whether a sliding window is known when tracing (None or a Python / NumPy int): kernels that build their masks
  ahead of time (splash, cuDNN) need that; per-layer windows scanned with the weights are traced."""
  return window is None or isinstance(window, (int, np.integer))


def row_axes(rows: int) -> tuple[str, ...] | None:
  """The data-parallel axes of the current mesh (`DATA_AXES`, those larger than 1) for a shard_map spec of
  `rows` leading rows: None (rows whole on every device) without a mesh or where they do not split evenly."""
  mesh = jax.sharding.get_abstract_mesh()
  sizes = {} if mesh.empty else dict(mesh.shape)
  axes = tuple(a for a in DATA_AXES if sizes.get(a, 1) > 1)
  return axes if axes and rows % math.prod(sizes[a] for a in axes) == 0 else None
