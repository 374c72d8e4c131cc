from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jalign.kernels.target import DATA_AXES
from jalign.models.sharding import DEFAULT_RULES, MESH_SHAPE, make_mesh


def mesh_from_config(shape: tuple[int, ...], devices=None) -> Mesh:
  """(data, fsdp, tensor[, expert[, sequence]]) sizes over the devices of all processes (or `devices`, e.g. a TPU compile target's); one
  entry may be -1 for the remaining ones. Without -1 the mesh may be smaller than the machine: it takes the first
  devices."""
  devices = list(jax.devices() if devices is None else devices)
  fixed = int(np.prod([s for s in shape if s != -1]))
  if (len(shape) not in (3, 4, 5) or any(s == 0 or s < -1 for s in shape) or fixed > len(devices)
      or (-1 in shape and len(devices) % fixed)):
    raise ValueError(f"mesh.shape={tuple(shape)} does not fit the {len(devices)} available devices ({MESH_SHAPE}: "
                     "positive sizes whose product is at most the device count, or -1 once for the rest)")
  return make_mesh(tuple(shape), devices if -1 in shape else devices[:fixed])


def split_meshes(shape: tuple[int, ...], rollout_shape: tuple = (), devices=None) -> tuple[Mesh, Mesh | None]:
  """The training mesh and, with `rollout_shape`, a sampling mesh of its own over devices set apart: each process's
  last prod(rollout_shape) / process-count local devices, so both meshes span every process (a program on either
  involves every process's own devices and none of the other mesh's). The training mesh takes the rest (its -1
  counts them)."""
  if not rollout_shape:
    return mesh_from_config(shape, devices), None
  devices = list(jax.devices() if devices is None else devices)
  processes = sorted({d.process_index for d in devices})
  r = int(np.prod(rollout_shape))
  if len(rollout_shape) not in (3, 4) or min(rollout_shape) < 1 or r % len(processes) or r >= len(devices):
    raise ValueError(f"grpo.rollout_mesh={tuple(rollout_shape)}: positive sizes (data, fsdp, tensor[, expert]) whose "
                     f"product is below the {len(devices)} devices and a multiple of the {len(processes)} processes")
  per = r // len(processes)
  apart = [d for p in processes for d in [x for x in devices if x.process_index == p][-per:]]
  rest = [d for d in devices if d not in apart]
  try:
    train = mesh_from_config(shape, rest)
  except ValueError as e:
    raise ValueError(f"{e}; grpo.rollout_mesh={tuple(rollout_shape)} sets {r} of them apart") from None
  return train, make_mesh(tuple(rollout_shape), apart)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, leading_micro_axis: bool = False) -> NamedSharding:
  """Examples split over the data-parallel axes (`DATA_AXES`); an optional micro-batch axis in front."""
  spec = (None, DATA_AXES) if leading_micro_axis else (DATA_AXES,)
  return NamedSharding(mesh, P(*spec))


def optimizer_shardings(optimizer: optax.GradientTransformation, param_shardings, params_abstract, mesh: Mesh):
  """Shardings for `optimizer.init(params)`: per-parameter state like its parameter, the rest replicated."""
  abstract_state = jax.eval_shape(optimizer.init, params_abstract)
  return optax.tree_map_params(optimizer, lambda _, s: s, abstract_state, param_shardings,
                               transform_non_params=lambda _: replicated(mesh))


def in_memory(tree, kind: str):
  """`tree` moved to memory `kind` ("device" or "pinned_host"), each array keeping its sharding's layout."""
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(kind)), tree)


def fetching(fn, host_tree):
  """fn(tree, *args) for a tree kept in host memory (`in_memory(tree, "pinned_host")`): inside the jitted call it is
  copied to device memory for the computation, and the copy is freed afterwards; nothing of it stays resident."""
  device = jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), host_tree)
  return lambda tree, *args: fn(jax.device_put(tree, device), *args)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  shape: tuple[int, ...] = (1, -1, 1)        # (data, fsdp, tensor[, expert[, sequence]]); -1 = the remaining
                                             # devices; without -1, a mesh smaller than the machine uses the first
                                             # devices. `expert` splits MoE models' experts (and, like fsdp, the
                                             # examples and the other weights); `sequence` splits each example's
                                             # tokens (activations, ring attention); 1 when not given
  rules: tuple = DEFAULT_RULES               # logical axis -> mesh axis / tuple of axes / None
