"""The MoE layer on CPU: dropless grouped matmuls (`kernels.moe.experts_mlp`: the block-sparse `xla` form, and
`jax.lax.ragged_dot`) against the dense all-experts form (`kernels.moe.reference`) and transformers'
`Qwen3MoeSparseMoeBlock` (its loop over the chosen experts), value + gradient of the whole block (router and
experts), fp32, all measured in this run (best of `--repeats`); then XLA's compiled memory of each form.

64 experts, top 8 (norm_topk_prob), hidden 512, expert hidden 256, 4096 tokens (the shapes' ratios are Qwen3-30B-A3B's
at a quarter of its width).

  python benchmarks/moe.py                       # a few minutes on 2 cores
  python benchmarks/moe.py --topology=v5e:2x2    # memory also compiled for one TPU chip (bf16, megablox kernel)
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jalign.kernels import moe

E, K, D, F, T = 64, 8, 512, 256, 4096


def _weights(seed: int = 0):
  rng = np.random.default_rng(seed)
  return dict(router=rng.normal(0, 0.02, (D, E)).astype(np.float32),
              gate=rng.normal(0, 0.02, (E, D, F)).astype(np.float32),
              up=rng.normal(0, 0.02, (E, D, F)).astype(np.float32),
              down=rng.normal(0, 0.02, (E, F, D)).astype(np.float32),
              x=rng.normal(0, 1, (T, D)).astype(np.float32))


def _block(form: str, impl: str = "xla"):
  def loss(x, router, gate, up, down):
    weights, ids = moe.route(x @ router, K, normalize=True)
    if form == "grouped":
      out = moe.experts_mlp(x, ids, weights.astype(x.dtype), gate, up, down, moe.gated(jax.nn.silu), impl=impl)
    else:
      out = moe.reference(x, ids, weights.astype(x.dtype), gate, up, down, moe.gated(jax.nn.silu))
    return jnp.sum(out.astype(jnp.float32) ** 2)
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


def _best(fn, repeats: int) -> float:
  fn()
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - start)
  return best


def jax_seconds(form: str, w: dict, repeats: int, impl: str = "xla") -> float:
  step = jax.jit(_block(form, impl))
  args = [jnp.asarray(w[k]) for k in ("x", "router", "gate", "up", "down")]
  return _best(lambda: jax.block_until_ready(step(*args)), repeats)


def transformers_seconds(w: dict, repeats: int) -> float:
  import torch
  import transformers
  torch.set_num_threads(2)
  cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                                    norm_topk_prob=True)
  block = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock(cfg)
  with torch.no_grad():
    block.gate.weight.copy_(torch.tensor(w["router"].T))
    block.experts.gate_up_proj.copy_(torch.tensor(np.concatenate([w["gate"], w["up"]], -1).transpose(0, 2, 1)))
    block.experts.down_proj.copy_(torch.tensor(w["down"].transpose(0, 2, 1)))
  x = torch.tensor(w["x"])[None].requires_grad_(True)

  def step():
    block.zero_grad()
    x.grad = None
    (block(x) ** 2).sum().backward()
  return _best(step, repeats)


def compiled_bytes(form: str, dtype=jnp.float32, mesh=None, impl: str = "xla") -> dict:
  sharding = None if mesh is None else jax.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sd = lambda shape: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
  args = (sd((T, D)), sd((D, E)), sd((E, D, F)), sd((E, D, F)), sd((E, F, D)))
  if mesh is None:
    compiled = jax.jit(_block(form, impl)).lower(*args).compile()
  else:
    with jax.set_mesh(mesh):
      compiled = jax.jit(_block(form, impl)).lower(*args).compile()
  m = compiled.memory_analysis()
  return {"temp_MB": m.temp_size_in_bytes / 1e6, "argument_MB": m.argument_size_in_bytes / 1e6}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--topology", default="", help="also compile for one chip of this TPU topology, e.g. v5e:2x2")
  args = parser.parse_args()
  w = _weights()
  grouped, dense = jax_seconds("grouped", w, args.repeats), jax_seconds("dense", w, args.repeats)
  ragged = jax_seconds("grouped", w, 1, impl="ragged")
  hf = transformers_seconds(w, args.repeats)
  print(f"MoE block value + gradient, {T} tokens, {E} experts top {K}, D {D}, F {F}, fp32, CPU "
        f"({jax.device_count()} device(s)):")
  print(f"  grouped (xla, blocks of {moe.BLOCK}) {grouped:.3f} s   grouped (ragged_dot) {ragged:.3f} s   "
        f"dense all-experts {dense:.3f} s   transformers {hf:.3f} s")
  print(f"  grouped is {dense / grouped:.2f}x the dense form, {hf / grouped:.2f}x transformers, "
        f"{ragged / grouped:.2f}x ragged_dot")
  g, r, d = compiled_bytes("grouped"), compiled_bytes("grouped", impl="ragged"), compiled_bytes("dense")
  print(f"  compiled temporaries: grouped {g['temp_MB']:.1f} MB, ragged_dot {r['temp_MB']:.1f} MB, dense "
        f"{d['temp_MB']:.1f} MB (grouped: {g['temp_MB'] / d['temp_MB']:.3f} of dense)")
  if args.topology:
    from jalign.parallel import tpu_target
    mesh = jax.sharding.Mesh(np.asarray(tpu_target.target(args.topology).devices).reshape(-1)[:1], ("x",))
    for impl in ("megablox", "xla"):
      b = compiled_bytes("grouped", jnp.bfloat16, mesh, impl)
      print(f"  {args.topology} one chip, bf16, grouped ({impl}): temporaries {b['temp_MB']:.1f} MB")
    b = compiled_bytes("dense", jnp.bfloat16, mesh)
    print(f"  {args.topology} one chip, bf16, dense: temporaries {b['temp_MB']:.1f} MB")


if __name__ == "__main__":
  main()
