"""Context-parallel attention on CPU: value + gradient of `kernels.context` over P fake devices of a `sequence` axis
(ring and all-gather forms, contiguous and zig-zag token orders) against `chunked` on one device at the same total
length, in the same run (best of `--repeats`).

On one CPU the P "devices" share its cores, so this measures the forms' overhead (extra block work, the ring's
hops, the all-gather), not a speed-up: a ratio near P x (1 / P) = 1 means no waste. One row, 8 query heads over 2
key/value heads of 64, fp32, causal.

  python benchmarks/context_attention.py               # T = 4096 over 4 shards
  python benchmarks/context_attention.py --tokens=8192 --shards=8
"""
from __future__ import annotations

import argparse
import os
import time

SHARDS_FLAG = "--xla_force_host_platform_device_count"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=4096)
  p.add_argument("--shards", type=int, default=4)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {SHARDS_FLAG}={args.shards}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jalign.kernels import attention
  from jalign.kernels.context import context_attention
  from jalign.kernels.zigzag import inverse, zigzag

  t, shards = args.tokens, args.shards
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, t, 8, 64)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(1, t, 2, 64)), jnp.float32) for _ in range(2))
  seg, pos = jnp.ones((1, t), jnp.int32), jnp.arange(t, dtype=jnp.int32)[None]

  def timed(fn, *a):
    fn(*a)[0].block_until_ready()  # compile
    best = float("inf")
    for _ in range(args.repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*a))
      best = min(best, time.perf_counter() - start)
    return best

  def grad_of(attend):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2), argnums=(0, 1, 2)))

  one = timed(grad_of(lambda q, k, v: attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos,
                                                kv_positions=pos, impl="chunked")), q, k, v)
  print(f"chunked, one device, T={t}: {one * 1e3:.0f} ms")
  mesh = jax.make_mesh((shards,), ("sequence",), axis_types=(jax.sharding.AxisType.Auto,))
  for form in ("ring", "gather"):
    for order_name in ("contiguous", "zigzag"):
      order = np.arange(t) if order_name == "contiguous" else zigzag(t, shards)
      lay = lambda a: a[:, order]  # noqa: E731

      def attend(q, k, v, form=form, lay=lay, order=order):
        out = context_attention(lay(q), lay(k), lay(v), lay(seg), lay(seg), lay(pos), lay(pos), scale=64 ** -0.5,
                                form=form)
        return out[:, inverse(order)]

      with jax.set_mesh(mesh):
        took = timed(grad_of(attend), q, k, v)
      print(f"{form:6s} {order_name:10s} over {shards} shards: {took * 1e3:.0f} ms, {took / one:.2f}x one device's "
            "chunked")


if __name__ == "__main__":
  main()
