"""TPU as a compile target on any host: a Cloud TPU accelerator type (v5p-8, v5e-8, v6e-8, v5p-64, ...) or a
libtpu topology name (v5e:2x2) -> that slice's TPU devices, for `jax.jit(...).lower(...).compile()` ahead of time.

Needs libtpu (`pip install "jax[tpu]"`), not a TPU: the compiled executable's `memory_analysis()` is the chip's
HBM use. (Its `cost_analysis()` FLOPs count a `while` loop's body once, so they miss the layers of a scanned
decoder and the blocks of a looped kernel: step times come from model FLOPs instead, see `jalign.fit`.)
"""
from __future__ import annotations

import dataclasses
import os
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation. `megacore`: two TensorCores act as one device and Cloud TPU's accelerator types count
  cores (v5p-8 is 4 chips); otherwise they count chips."""
  name: str
  generation: str          # libtpu's topology prefix
  hbm_gib: float           # per chip
  peak_bf16_tflops: float  # dense, per chip
  hbm_gb_per_s: float
  megacore: bool
  dims: int                # torus dimensions of a slice
  device_kind: str         # what jax's devices call it


# Per-chip figures from the Cloud TPU system-architecture pages (v4, v5e, v5p, v6e).
CHIPS = {
    "v4": Chip("TPU v4", "v4", 32, 275, 1200, True, 3, "TPU v4"),
    "v5e": Chip("TPU v5e", "v5e", 16, 197, 819, False, 2, "TPU v5 lite"),
    "v5p": Chip("TPU v5p", "v5", 95, 459, 2765, True, 3, "TPU v5"),
    "v6e": Chip("TPU v6e", "v6e", 32, 918, 1640, False, 2, "TPU v6 lite"),
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5": "v5p", "v6": "v6e"}


@dataclasses.dataclass(frozen=True)
class Target:
  chip: Chip
  topology: str            # libtpu topology name, e.g. "v5:2x2x1"
  devices: tuple           # jax TPU devices (one per chip), for a Mesh

  @property
  def num_chips(self) -> int:
    return len(self.devices)

  def seconds_at_peak(self, flops_per_chip: float) -> float:
    """A lower bound on the time of that many FLOPs on one chip: its dense bf16 peak."""
    return flops_per_chip / (self.chip.peak_bf16_tflops * 1e12)


def slice_shape(chip: Chip, chips: int) -> tuple[int, ...]:
  """The torus shape Cloud TPU gives a slice of `chips` chips (v5e-8: 2x4; v5p-8, 4 chips: 2x2x1; 32: 2x4x4)."""
  if chips < 1 or chips & (chips - 1):
    raise ValueError(f"{chips} chips: TPU slices have a power-of-two chip count")
  if chip.dims == 3 and chips <= 4:
    return {1: (1, 1, 1), 2: (2, 1, 1), 4: (2, 2, 1)}[chips]
  dims = [1] * chip.dims
  while dims[0] * dims[1] * (dims[2] if chip.dims == 3 else 1) < chips:
    dims[dims.index(min(dims))] *= 2
  return tuple(sorted(dims))


def parse(name: str) -> tuple[Chip, str]:
  """An accelerator type ("v5p-8", "v5litepod-16", "v6e-8") or a topology ("v5e:2x2", "v5p:2x2x1") -> (chip,
  libtpu topology name)."""
  accepted = (f"an accelerator type GEN-N (GEN one of {', '.join(sorted(CHIPS))}, or v5litepod; N cores on v4/v5p, "
              "chips on v5e/v6e), or a topology GEN:AxB[xC]")
  m = re.fullmatch(r"(v\d+[a-z]*)([-:])([\dx]+)", name.strip().lower())
  gen = m and _ALIASES.get(m.group(1), m.group(1))
  if not m or gen not in CHIPS:
    raise ValueError(f"TPU target {name!r}: expected {accepted}")
  chip = CHIPS[gen]
  if m.group(2) == ":":
    shape = tuple(int(x) for x in m.group(3).split("x") if x)
    if len(shape) != chip.dims:
      raise ValueError(f"TPU target {name!r}: a {chip.name} topology has {chip.dims} dimensions")
  else:
    count = int(m.group(3))
    chips = count // 2 if chip.megacore else count
    if chip.megacore and count % 2:
      raise ValueError(f"TPU target {name!r}: {chip.name} accelerator types count TensorCores, two per chip")
    shape = slice_shape(chip, chips)
  return chip, f"{chip.generation}:{'x'.join(map(str, shape))}"


def target(name: str) -> Target:
  """The TPU devices of `name`'s slice (see `parse`), from libtpu's topology description: compile for them with a
  Mesh over `devices`; nothing runs on them. (Where JAX initialises its TPU backend at start-up, i.e. without
  JAX_PLATFORMS=cpu, libtpu is loaded before this runs: set ALLOW_MULTIPLE_LIBTPU_LOAD=1 before importing jax, as
  `python -m jalign.fit --topology` does, for several such processes at once.)"""
  chip, topology = parse(name)
  # libtpu takes a host-wide lock file when it loads; compiling needs no chip, so several processes may hold it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  try:
    from jax.experimental import topologies
    kw = {"chip_config_name": "megacore"} if chip.megacore else {}
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology, **kw)
  except Exception as e:  # noqa: BLE001  libtpu absent or the topology unknown to it: say which and how to fix
    raise RuntimeError(f"cannot describe TPU topology {topology!r} ({name}): {e}. Compiling for a TPU on this host "
                       "needs libtpu: pip install 'jax[tpu]'") from e
  return Target(chip, topology, tuple(desc.devices))


def chip_mesh(name: str):
  """A mesh of one chip of `name`'s slice: to compile a kernel or a step for one chip."""
  from jalign.models.sharding import make_mesh
  return make_mesh((1, 1, 1), target(name).devices[:1])


def temporaries(memory_analysis) -> int:
  """Bytes a compiled TPU program needs beyond its arguments and outputs: XLA's temp bytes or, where larger, its peak
  less arguments and outputs (Pallas / Mosaic kernels' buffers show only in the peak)."""
  m = memory_analysis
  return max(m.temp_size_in_bytes,
             m.peak_memory_in_bytes - m.argument_size_in_bytes - m.output_size_in_bytes + m.alias_size_in_bytes)
