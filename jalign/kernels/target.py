"""The platform a kernel is being compiled for."""
from __future__ import annotations

import jax


def target_platform() -> str:
  """That of the devices of the mesh set by `jax.set_mesh` (a TPU topology's when compiling ahead of time for one
  on another host), else the default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.default_backend() if mesh.empty else mesh.abstract_device.platform
