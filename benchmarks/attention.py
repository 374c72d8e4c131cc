"""Attention on CPU: time of `chunked` (flash attention in pure JAX) against the dense `xla` form, value + gradient,
and the compiled memory of both against the sequence length.

Time: one row of T tokens, 8 query heads over 4 key/value heads of 64, fp32, causal, both measured in this run
(best of `--repeats`); unpacked (one sequence) and packed (sequences of 64-1024 tokens, positions restarting, as SFT
packs them). Memory: XLA's temporaries of the compiled value + gradient (compiled only, never run).

  python benchmarks/attention.py            # T = 512, 2048, 8192; memory to 32768; a few minutes on 2 cores
  python benchmarks/attention.py --quick    # T = 512 and 2048 only
  python benchmarks/attention.py --topology=v5e:2x2   # also compiled for one TPU chip: bf16, 8 heads of 128,
                                                      # xla at 8192 against splash and chunked at 8192 and 32768
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jalign.kernels import attention

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def _inputs(t: int, packed: bool, seed: int = 0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(1, t, HEADS, HEAD_DIM)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, t, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
  seg, pos = np.ones((1, t), np.int32), np.arange(t, dtype=np.int32)[None]
  if packed:
    start, s = 0, 1
    while start < t:
      n = int(rng.integers(64, 1025))
      seg[0, start:start + n], pos[0, start:start + n] = s, np.arange(min(n, t - start))
      start, s = start + n, s + 1
  return q, k, v, jnp.asarray(seg), jnp.asarray(pos)


def _step(impl):
  def loss(q, k, v, seg, pos):
    out = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, impl=impl)
    return jnp.sum(out * out)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def seconds(impl: str, t: int, packed: bool, repeats: int) -> float:
  args = _inputs(t, packed)
  step = _step(impl)
  jax.block_until_ready(step(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    best = min(best, time.perf_counter() - start)
  return best


def temp_bytes(impl: str, t: int) -> int:
  sd = jax.ShapeDtypeStruct
  args = (sd((1, t, HEADS, HEAD_DIM), jnp.float32), *[sd((1, t, KV_HEADS, HEAD_DIM), jnp.float32)] * 2,
          sd((1, t), jnp.int32), sd((1, t), jnp.int32))
  return _step(impl).lower(*args).compile().memory_analysis().temp_size_in_bytes


def tpu_temp_bytes(impl: str, t: int, topology: str) -> int:
  from jalign.parallel import tpu_target
  mesh = tpu_target.chip_mesh(topology)
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, P()))  # noqa: E731
  q, seg = sd((1, t, 8, 128), jnp.bfloat16), sd((1, t), jnp.int32)

  def loss(q, k, v, s):
    return jnp.sum(attention(q, k, v, q_segment_ids=s, kv_segment_ids=s, impl=impl).astype(jnp.float32))

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, q, q, seg).compile()
  return tpu_target.temporaries(compiled.memory_analysis())


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="T = 512 and 2048 only")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--topology", default="", help="also compile for one chip of this TPU slice (libtpu, no TPU)")
  args = parser.parse_args()
  lengths = (512, 2048) if args.quick else (512, 2048, 8192)
  print(f"value + gradient, {HEADS} heads over {KV_HEADS} kv heads of {HEAD_DIM}, fp32, causal, "
        f"{jax.devices()[0].device_kind}:")
  print(f"  {'T':>6s} {'layout':>8s} {'xla':>9s} {'chunked':>9s} {'chunked/xla':>12s}")
  ratios = {}
  for t in lengths:
    for packed in (False, True):
      x, c = seconds("xla", t, packed, args.repeats), seconds("chunked", t, packed, args.repeats)
      ratios[t, packed] = c / x
      print(f"  {t:6d} {'packed' if packed else 'one':>8s} {x * 1e3:7.0f}ms {c * 1e3:7.0f}ms {c / x:12.2f}",
            flush=True)
  print("compiled temporaries (MiB):")
  print(f"  {'T':>6s} {'xla':>9s} {'chunked':>9s}")
  for t in (1024, 4096) if args.quick else (1024, 4096, 16384, 32768):
    print(f"  {t:6d} {temp_bytes('xla', t) / 2**20:9.1f} {temp_bytes('chunked', t) / 2**20:9.1f}", flush=True)
  if args.topology:
    print(f"compiled for one {args.topology} chip, value + gradient temporaries (MiB), bf16, 8 heads of 128:")
    dense = tpu_temp_bytes("xla", 8192, args.topology)
    print(f"  xla T=8192 {dense / 2**20:,.1f} (x16 for T=32768: {16 * dense / 2**20:,.0f})")
    for impl in ("splash", "chunked"):
      for t in (8192, 32768):
        b = tpu_temp_bytes(impl, t, args.topology)
        print(f"  {impl} T={t} {b / 2**20:,.1f} ({b / (dense * (t / 8192) ** 2):.2%} of xla scaled by T^2)",
              flush=True)
  print(f"chunked/xla time ratio at 2048 (one sequence, packed): {ratios[2048, False]:.2f}, {ratios[2048, True]:.2f}")


if __name__ == "__main__":
  main()
