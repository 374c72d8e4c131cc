"""Logical axis names -> mesh shardings.

Convention (used project-wide): meshes are built with `AxisType.Auto` axes, parameters are placed with explicit
`NamedSharding`s derived from their logical axis names through a rules table, and XLA's sharding propagation lays
out the activations. A rule maps a logical name to a mesh axis, a tuple of mesh axes, or None (replicated).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jalign.kernels.target import AXIS_NAMES, DATA_AXES

MESH_SHAPE = "(data, fsdp, tensor), (data, fsdp, tensor, expert) or (data, fsdp, tensor, expert, sequence)"
AXES = "axes"  # nnx.Param metadata key holding the parameter's logical axis names

# Training layout: FSDP over `fsdp` (and `expert`, and `sequence`: its devices hold different tokens of the same
# examples, so like data-parallel ones they can share out the weights, as MaxText's context axis does) on the model
# dimension, Megatron-style TP over `tensor` on heads / MLP / vocab, routed experts split over `expert`.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", DATA_AXES),
    ("vocab", "tensor"),
    # An expert's weights take `expert` for the experts dimension first, so on them `embed` gets `fsdp` alone.
    ("embed", ("fsdp", "sequence", "expert")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("router", None),
    ("latent", None),  # MLA's compressed query / key-value dims: small, kept whole
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("cache_seq", None),
    # LoRA adapters' heads / MLP dims: over both axes, so FSDP shards the adapters (and their optimizer state) too.
    ("lora", ("fsdp", "tensor")),
)


def without_fsdp(rules=DEFAULT_RULES):
  """The sampling layout (tunix / Levanter style): the same rules with the 'fsdp' and 'sequence' axes dropped (and
  'expert' but for the experts themselves), so weights are replicated across FSDP shards (still split over 'tensor', routed
  experts over 'expert') and a decode step all-gathers nothing."""
  out = []
  for name, target in rules:
    axes = (target,) if isinstance(target, str) else tuple(target or ())
    kept = tuple(a for a in axes if a not in ("fsdp", "sequence") and (a != "expert" or name == "experts"))
    out.append((name, kept[0] if len(kept) == 1 else (kept or None)))
  return tuple(out)


def make_mesh(shape: tuple[int, ...], devices=None) -> Mesh:
  """An `AXIS_NAMES` mesh with Auto axes from sizes (data, fsdp, tensor[, expert[, sequence]]), those not given 1;
  one entry may be -1 (the remaining devices)."""
  devices = np.asarray(devices if devices is not None else jax.devices())
  if len(shape) not in (3, 4, 5):
    raise ValueError(f"mesh shape {tuple(shape)}: sizes {MESH_SHAPE}")
  shape = list(shape) + [1] * (5 - len(shape))
  if shape.count(-1) > 1:
    raise ValueError(f"mesh shape {tuple(shape)}: at most one axis may be -1")
  if -1 in shape:
    rest = int(np.prod([s for s in shape if s != -1]))
    shape[shape.index(-1)] = devices.size // rest
  if int(np.prod(shape)) != devices.size:
    raise ValueError(f"mesh shape {tuple(shape)} needs {int(np.prod(shape))} devices; {devices.size} available")
  data, fsdp, tensor, expert, sequence = shape
  return jax.make_mesh((data, fsdp, expert, sequence, tensor), AXIS_NAMES, devices=devices.tolist(),
                       axis_types=(jax.sharding.AxisType.Auto,) * len(AXIS_NAMES))


def logical_to_spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES) -> P:
  """PartitionSpec for an array; a mesh axis is dropped for a dimension it does not divide (replicated there)
  and never used twice."""
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name, dim in zip(axes, shape):
    target = table.get(name) if name is not None else None
    target = (target,) if isinstance(target, str) else tuple(target or ())
    chosen = []
    for ax in target:
      size = mesh.shape.get(ax, 1)
      if ax in used or size == 1 or dim % (size * int(np.prod([mesh.shape[a] for a in chosen]))):
        continue
      chosen.append(ax)
    used.update(chosen)
    spec.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
  return P(*spec)


def named_sharding(axes: tuple, shape: tuple[int, ...], mesh: Mesh, rules=DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules))


def logical_axes(model: nnx.Module) -> Any:
  """The parameter state of `model` with each parameter replaced by its tuple of logical axis names."""
  return jax.tree.map(lambda v: v.get_metadata().get(AXES) or (None,) * v.ndim,
                      nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(model: nnx.Module, mesh: Mesh, rules=DEFAULT_RULES) -> Any:
  """NamedSharding for every parameter of `model` (abstract or concrete), shaped like `nnx.state(model, Param)`."""
  return jax.tree.map(lambda v: named_sharding(v.get_metadata().get(AXES) or (None,) * v.ndim, v.shape, mesh, rules),
                      nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))


def to_host(tree):
  """NumPy copies of an array or a tree of arrays: the one way jalign brings device values to the host. An array
  with shards on other processes is gathered first: a collective, so every process must make the same calls in the
  same order (a replicated array is read from a local copy)."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))
  return jax.tree.map(one, tree)
