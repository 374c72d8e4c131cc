from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jalign.models.sharding import DEFAULT_RULES, make_mesh


def mesh_from_config(shape: tuple[int, int, int], devices=None) -> Mesh:
  """('data', 'fsdp', 'tensor') over the devices of all processes (or `devices`, e.g. a TPU compile target's); one
  entry may be -1 for the remaining ones. Without -1 the mesh may be smaller than the machine: it takes the first
  devices."""
  devices = list(jax.devices() if devices is None else devices)
  fixed = int(np.prod([s for s in shape if s != -1]))
  if any(s == 0 or s < -1 for s in shape) or fixed > len(devices) or (-1 in shape and len(devices) % fixed):
    raise ValueError(f"mesh.shape={tuple(shape)} does not fit the {len(devices)} available devices "
                     "(positive sizes whose product is at most the device count, or -1 once for the rest)")
  return make_mesh(tuple(shape), devices if -1 in shape else devices[:fixed])


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, leading_micro_axis: bool = False) -> NamedSharding:
  """Examples split over the data-parallel axes ('data', 'fsdp'); an optional micro-batch axis in front."""
  spec = (None, ("data", "fsdp")) if leading_micro_axis else (("data", "fsdp"),)
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
  shape: tuple[int, int, int] = (1, -1, 1)   # ('data', 'fsdp', 'tensor'); -1 = the remaining devices; without
                                             # -1, a mesh smaller than the machine uses the first devices
  rules: tuple = DEFAULT_RULES               # logical axis -> mesh axis / tuple of axes / None
