"""MXFP4 expert weights (gpt-oss hub checkpoints), dequantised on load.

The OCP Microscaling format: blocks of 32 FP4 (E2M1) values that share one E8M0 scale. A checkpoint stores a
projection [E, out, in] as `*_blocks` uint8 [E, out, in / 32, 16] (two values per byte, the low nibble first) and
`*_scales` uint8 [E, out, in / 32] (2 ** (scale - 127)); the plain layout is the transpose, [E, in, out]. Every
value is exact in bfloat16, so dequantising loses nothing."""
from __future__ import annotations

import ml_dtypes
import numpy as np

# E2M1: sign, two exponent bits, one mantissa bit (the OCP MX spec's FP4 table)
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """float32 [..., G * 32] from blocks uint8 [..., G, 16] and scales uint8 [..., G]."""
  blocks = np.asarray(blocks, np.uint8)
  if blocks.shape[:-1] != np.shape(scales) or blocks.shape[-1] != 16:
    raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {np.shape(scales)}: expected [..., G, 16] and [..., G]")
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # [..., G, 16, 2]
  values = np.ldexp(values.reshape(*blocks.shape[:-1], 32), np.asarray(scales, np.int32)[..., None] - 127)
  return values.reshape(*blocks.shape[:-2], -1)


class Packed:
  """A checkpoint's MXFP4 projection seen as its plain [E, in, out] tensor (bfloat16): indexing dequantises only the
  experts asked for."""
  dtype = np.dtype(ml_dtypes.bfloat16)

  def __init__(self, blocks, scales):
    self.blocks, self.scales = blocks, scales
    E, out, groups, _ = blocks.shape
    self.shape = (E, groups * 32, out)

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    experts = index[0] if isinstance(index[0], slice) else slice(index[0], index[0] + 1)
    plain = dequantize(self.blocks[experts], self.scales[experts]).swapaxes(-1, -2).astype(self.dtype)
    rest = (slice(None),) + tuple(index[1:]) if isinstance(index[0], slice) else (0,) + tuple(index[1:])
    return plain[rest]
