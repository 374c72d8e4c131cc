"""Memory and time of token_logprobs' value + gradient: `chunked` (and `full_kl`) against the materialising `xla`.

Memory is XLA's own accounting of the compiled program (temporary bytes, i.e. everything but arguments and
outputs), so large shapes are only compiled, never run. Time is measured at a size where `xla` fits, both in one run.

  python benchmarks/logprob_memory.py            # T=8192, D=2048, V=128256 in bf16; growth tables; CPU time ratio
  python benchmarks/logprob_memory.py --topology=v5e:2x2   # also compiled for one TPU chip: xla, chunked, pallas_tpu

On a TPU compile the Pallas kernel's buffers do not show in XLA's temp bytes, so there "temporaries" are the larger of
those and the compiler's peak less arguments and outputs.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jalign.kernels import full_kl, token_logprobs
from jalign.kernels.chunked import chunk_columns


def _fn(impl, chunk):
  return jax.jit(jax.value_and_grad(
      lambda h, w, y: jnp.sum(token_logprobs(h, w, y, impl=impl, chunk=chunk)[0]), argnums=(0, 1)))


def temp_bytes(impl: str, t: int, d: int, v: int, dtype, chunk: int) -> int:
  sd = jax.ShapeDtypeStruct
  compiled = _fn(impl, chunk).lower(sd((t, d), dtype), sd((d, v), dtype), sd((t,), jnp.int32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def kl_temp_bytes(impl: str, t: int, d: int, v: int, dtype, chunk: int) -> int:
  sd = jax.ShapeDtypeStruct
  f = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(full_kl(*a, impl=impl, chunk=chunk)), argnums=(0, 1)))
  args = (sd((t, d), dtype), sd((d, v), dtype)) * 2
  return f.lower(*args).compile().memory_analysis().temp_size_in_bytes


def tpu_temp_bytes(impl: str, t: int, d: int, v: int, topology: str) -> int:
  from jalign.parallel import tpu_target
  mesh = tpu_target.chip_mesh(topology)
  sd = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=jax.NamedSharding(mesh, P()))  # noqa: E731

  def loss(h, w, y):
    logp, entropy, _ = token_logprobs(h, w, y, impl=impl)
    return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

  with jax.set_mesh(mesh):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        sd((t, d), jnp.bfloat16), sd((d, v), jnp.bfloat16), sd((t,), jnp.int32)).compile()
  return tpu_target.temporaries(compiled.memory_analysis())


def seconds(impl: str, t: int, d: int, v: int, chunk: int, repeats: int) -> float:
  rng = np.random.RandomState(0)
  h = jnp.asarray(rng.randn(t, d), jnp.float32)
  w = jnp.asarray(rng.randn(d, v) * 0.05, jnp.float32)
  y = jnp.asarray(rng.randint(0, v, t))
  f = _fn(impl, chunk)
  jax.block_until_ready(f(h, w, y))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(f(h, w, y))
    best = min(best, time.perf_counter() - start)
  return best


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--tokens", type=int, default=8192)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--vocab", type=int, default=128256)
  ap.add_argument("--chunk", type=int, default=0, help="vocabulary columns per chunk; 0 = from the memory budget")
  ap.add_argument("--topology", default="", help="also compile for one chip of this TPU slice (libtpu, no TPU)")
  ap.add_argument("--time-shape", type=int, nargs=3, default=(1024, 256, 32768), metavar=("T", "D", "V"))
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args()
  gib = 2.0 ** 30
  bf16 = jnp.bfloat16

  t, d, v = args.tokens, args.hidden, args.vocab
  x, c = temp_bytes("xla", t, d, v, bf16, args.chunk), temp_bytes("chunked", t, d, v, bf16, args.chunk)
  print(f"value+grad temp memory, T={t} D={d} V={v} bf16, chunk {args.chunk or chunk_columns(t, v)}:")
  print(f"  xla {x / gib:.2f} GiB   chunked {c / gib:.3f} GiB   chunked/xla = {c / x:.2%}")
  kx, kc = kl_temp_bytes("xla", t, d, v, bf16, args.chunk), kl_temp_bytes("chunked", t, d, v, bf16, args.chunk)
  print(f"  full_kl: xla {kx / gib:.2f} GiB   chunked {kc / gib:.3f} GiB   chunked/xla = {kc / kx:.2%}")

  print("growth with T (D, V as above): T, xla GiB, chunked GiB")
  for tt in (1024, 2048, 4096, 8192, 16384):
    print(f"  {tt:6d}  {temp_bytes('xla', tt, d, v, bf16, args.chunk) / gib:7.2f}  "
          f"{temp_bytes('chunked', tt, d, v, bf16, args.chunk) / gib:7.3f}")
  print("growth with V (T, D as above): V, xla GiB, chunked GiB")
  for vv in (32000, 64000, 128256, 256000):
    print(f"  {vv:6d}  {temp_bytes('xla', t, d, vv, bf16, args.chunk) / gib:7.2f}  "
          f"{temp_bytes('chunked', t, d, vv, bf16, args.chunk) / gib:7.3f}")

  if args.topology:
    tpu = {impl: tpu_temp_bytes(impl, t, d, v, args.topology) for impl in ("xla", "chunked", "pallas_tpu")}
    print(f"compiled for one {args.topology} chip, value+grad temporaries, T={t} D={d} V={v} bf16: " + "   ".join(
        f"{impl} {b / 2**20:,.0f} MiB ({b / tpu['xla']:.1%})" for impl, b in tpu.items()))

  tt, dd, vv = args.time_shape
  sx = seconds("xla", tt, dd, vv, args.chunk, args.repeats)
  sc = seconds("chunked", tt, dd, vv, args.chunk, args.repeats)
  print(f"{jax.default_backend()} time, value+grad fp32, T={tt} D={dd} V={vv} (best of {args.repeats}): "
        f"xla {sx * 1e3:.0f} ms   chunked {sc * 1e3:.0f} ms   chunked/xla = {sc / sx:.2f}x")


if __name__ == "__main__":
  main()
