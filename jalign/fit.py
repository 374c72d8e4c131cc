"""Ahead-of-time fit check: compile a config's train step for a mesh and report the bytes it needs per device,
without allocating the model (every input is a `jax.ShapeDtypeStruct` with its sharding).

    python -m jalign.fit --config=configs/grpo.py --arch=llama3-8b --devices=16 \
        --config.mesh.shape="(1,16,1)" --config.model.dtype=bfloat16 --hbm_gib=95

`--devices` fakes that many host devices (the check runs on any machine, a laptop included); the figures are XLA's
own buffer assignment for the SPMD-partitioned step on one device: parameters and optimizer state (the step's
arguments), activations and temporaries (`temp`), and its outputs less what donation aliases back onto the inputs.
On an accelerator the compiler differs (fusion, layouts; the CPU compiler also runs bf16 matmuls in fp32, holding
fp32 copies of gathered weights), so the CPU figure for temporaries is an upper estimate; the parameter and
optimizer bytes are exact.

`--topology=v5p-8` (an accelerator type or libtpu topology: `jalign.parallel.tpu_target`) compiles the same step
for that TPU slice instead, on any host with libtpu: the figures are then the TPU compiler's HBM per chip, its
peak from its own buffer schedule, and a lower bound on the step time (model FLOPs at the chip's bf16 peak):

    python -m jalign.fit --config=configs/sft.py --arch=llama3-8b --topology=v5p-8 \
        --config.mesh.shape="(1,4,1)" --config.model.dtype=bfloat16 --config.model.remat=full \
        --config.train.batch_size=4 --config.train.seq_len=8192
"""
from __future__ import annotations

import json
import os
import re
import sys

# Preset shapes from the published Hugging Face configs (config.json of meta-llama/Meta-Llama-3-8B and -70B,
# Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B and openai/gpt-oss-20b); `rope_theta` and `rope` become
# the RoPE config.
_QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=151936, num_kv_heads=4, head_dim=128, qk_norm=True,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, num_experts=128, experts_per_token=8,
                  norm_topk_prob=True, rope_theta=1e6)
ARCHS = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                       num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
                       rope_theta=500000.0),
    # Qwen/Qwen3-8B: 36 layers, GQA 32/8, qk-norm, untied embeddings (8.19 B parameters).
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=True, max_position_embeddings=40960,
                     rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, num_layers=48, num_heads=32,
                          moe_intermediate_size=768),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, num_layers=94, num_heads=64,
                            moe_intermediate_size=1536),
    # 32 experts, top 4, of 2880 each; attention sinks, sliding (128) and full layers alternating, YaRN x32.
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, max_position_embeddings=131072,
                        rms_norm_eps=1e-5, num_experts=32, experts_per_token=4, moe_intermediate_size=2880,
                        norm_topk_prob=True, qkv_bias=True, out_bias=True, attn_sinks=True, router_bias=True,
                        expert_bias=True, swiglu_limit=7.0, sliding_window=128,
                        layer_types=("sliding_attention", "full_attention") * 12, rope_theta=150000.0,
                        rope=dict(kind="yarn", factor=32.0, truncate=False, original_max_position_embeddings=4096)),
}


def arch_config(name: str):
  """The `ModelConfig` of a preset (`ARCHS`)."""
  from jalign.models.config import ModelConfig, RopeConfig
  shape = dict(ARCHS[name])
  rope = RopeConfig(theta=shape.pop("rope_theta"), **shape.pop("rope", {}))
  return ModelConfig(**shape, rope=rope)


def _tree_bytes_per_device(abstract_tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard of each leaf)."""
  import jax
  import numpy as np
  total = 0
  for leaf in jax.tree.leaves(abstract_tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    total += int(np.prod(shape)) * leaf.dtype.itemsize
  return total


def report(cfg, arch: str = "", target=None) -> dict:
  """Compiles `cfg`'s train step on the current devices, or for a TPU slice (`target`: a
  `tpu_target.Target`), and returns per-device bytes (see the module doc)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from jalign import models, parallel, tasks
  from jalign.core.errors import ConfigError
  from jalign.models import lora
  from jalign.models.hf_config import load_hf_config
  from jalign.train.step import Trainable, TrainState

  if cfg.task == "distill":
    raise ConfigError("task 'distill': the fit check does not size a step with a teacher beside the student yet; "
                      "check the student as an SFT run (--config.task=sft) and add the teacher's parameters")
  m = cfg.model
  if arch:
    model_cfg = arch_config(arch)
  elif m.path:
    model_cfg = load_hf_config(m.path)[0]
  else:
    model_cfg = m.arch
  model_cfg = model_cfg.replace(param_dtype=m.dtype, dtype=m.compute_dtype or m.dtype, **m.knobs())
  if cfg.task == "rm":  # a reward model's backbone has no LM head of its own (`tasks.rm.load_reward_model`)
    model_cfg = model_cfg.replace(tie_embeddings=True)
  mesh = parallel.mesh_from_config(cfg.mesh.shape, None if target is None else target.devices)
  task = tasks.task(cfg)

  def build():
    lm = models.Decoder(model_cfg, rngs=nnx.Rngs(0))
    if m.lora.rank:
      lora.add_adapters(lm, m.lora)
    if cfg.task == "rm":
      from jalign.models.reward_model import RewardModel
      from jalign.tasks.rm import score_head
      return RewardModel(lm, score_head(cfg, model_cfg.hidden_size))
    return lm

  abstract = nnx.eval_shape(build)
  graphdef, state = nnx.split(abstract)
  params = nnx.to_pure_dict(state)
  param_sh = nnx.to_pure_dict(models.state_shardings(abstract, mesh, cfg.mesh.rules))
  frozen = frozen_sh = None
  if m.lora.rank:
    params, frozen = lora.partition(params)
    param_sh, frozen_sh = lora.partition(param_sh)
  with_sharding = lambda tree, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                                tree, sh)
  optimizer, schedule = task.update_optimizer()
  opt_sh = parallel.optimizer_shardings(optimizer, param_sh, params, mesh)
  rep = parallel.replicated(mesh)
  scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  state = TrainState(scalar, with_sharding(params, param_sh), with_sharding(jax.eval_shape(optimizer.init, params),
                                                                             opt_sh), scalar)
  state_sh = TrainState(rep, param_sh, opt_sh, rep)
  # The run's own update of the task (loss, micro-batches, optimizer, shardings, donation) on the largest batch
  # it takes: the program the run compiles, not a copy of it.
  jitted = task.jit_update(mesh, Trainable(graphdef, state, state_sh, frozen, frozen_sh), optimizer, schedule)
  batch_sh = parallel.batch_sharding(mesh)
  batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sh), task.abstract_batch(model_cfg))
  columns = batch if isinstance(batch, dict) else batch.columns()  # GRPO / PPO: a RolloutBatch
  with jax.set_mesh(mesh):
    lowered = jitted.lower(state, batch, None if frozen is None else with_sharding(frozen, frozen_sh))
    try:
      compiled, oom = lowered.compile(), None
    except Exception as e:  # noqa: BLE001  the TPU compiler refuses a program over the chip's HBM
      oom = out_of_memory(str(e)) if target is not None else None
      if oom is None:
        raise
  out = {
      "devices": int(mesh.size), "mesh": dict(mesh.shape), "task": cfg.task, "micro_batches": task.micro_batches(),
      "batch": {k: list(v.shape) for k, v in columns.items()},
      "params_total": int(sum(x.size for x in jax.tree.leaves(params)) +
                          sum(x.size for x in jax.tree.leaves(frozen or {}))),
      "trainable_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "bytes_per_device": {
          "params": _tree_bytes_per_device(state.params) + (
              _tree_bytes_per_device(with_sharding(frozen, frozen_sh)) if frozen is not None else 0),
          "optimizer_state": _tree_bytes_per_device(state.opt_state)}}
  b = out["bytes_per_device"]
  if oom is None:
    mem = compiled.memory_analysis()
    b.update(arguments=int(mem.argument_size_in_bytes), temp=int(mem.temp_size_in_bytes),
             outputs=int(mem.output_size_in_bytes), aliased=int(mem.alias_size_in_bytes))
  else:  # the program's own need (the compiler's figure) on top of the train state: a lower bound on the peak
    b.update(arguments=b["params"] + b["optimizer_state"], temp=oom["program"], outputs=0, aliased=0)
    out["out_of_memory"] = oom
  b["peak_estimate"] = b["arguments"] + b["temp"] + b["outputs"] - b["aliased"]
  if target is not None:  # the TPU compiler's own peak (its buffer schedule), and a FLOP-bound step time
    b["peak"] = (int(getattr(mem, "peak_memory_in_bytes", 0)) if oom is None else 0) or b["peak_estimate"]
    flops = model_flops(model_cfg, columns["tokens"].shape, out["params_total"], out["trainable_params"],
                        lora.routed_adapter_size(params) if m.lora.rank else 0)
    out["target"] = {"chip": target.chip.name, "topology": target.topology, "chips": target.num_chips,
                     "hbm_gib": target.chip.hbm_gib, "model_flops_per_chip": flops / mesh.size,
                     "step_time_lower_bound_s": target.seconds_at_peak(flops / mesh.size)}
  return out


_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
  """'21.95G' / '530.00M' / '0B' (XLA's sizes, binary units) -> bytes."""
  m = re.fullmatch(r"([\d.]+)([KMGT]?)B?", text.strip())
  return int(float(m.group(1)) * _UNITS[m.group(2)])


def out_of_memory(message: str) -> dict | None:
  """The TPU compiler's out-of-memory error read into {"message" (its first sentence), "program" (bytes the
  program needs beyond its arguments), "capacity", "largest": [(bytes, shape, operation)] (the largest allocations,
  where the compiler lists them)}; None for any other error. libtpu 0.0.42 says `RESOURCE_EXHAUSTED: Ran out of
  memory on HBM, the total memory required for HLO temporaries (32.97G) exceeds available HBM (15.75G).`; older
  ones `... Ran out of memory in memory space hbm. Used 21.95G of 15.48G hbm ...` with a list of allocations."""
  size = r"([\d.]+[KMGT]?B?)"
  m = (re.search(rf"Ran out of memory on HBM, the total memory required for HLO temporaries \({size}\) exceeds "
                 rf"available HBM \({size}\)", message) or
       re.search(rf"Ran out of memory in memory space hbm\. Used {size} of {size} hbm", message))
  if m is None:
    return None
  program = re.search(rf"\n\s*program\s+{size}", message)
  largest = []
  for size, body in re.findall(r"\n\s*\d+\. Size: ([\d.]+[KMGT]?B?)\n(.*?)(?=\n\s*\d+\. Size:|\n\s*=+\s*\n|$)",
                               message, re.S):
    shape = re.search(r"Shape: (\S+)", body)
    op = re.search(r'op_name="([^"]*)"', body)
    largest.append((_bytes(size), shape.group(1) if shape else "", op.group(1) if op else ""))
  return {"message": m.group(0), "program": _bytes(program.group(1) if program else m.group(1)),
          "capacity": _bytes(m.group(2)), "largest": largest[:5]}


def model_flops(model_cfg, tokens_shape, params_total: int, trainable_params: int, routed_adapters: int = 0
                ) -> float:
  """Matmul FLOPs of one training step on a batch of `tokens_shape` ([..., T]): per token 2 x params forward,
  2 x params for the activations' gradient and 2 x trainable params for the weights' (PaLM, Chowdhery et al. 2022,
  appendix B: 6N per token), an untied input embedding excluded (a lookup), plus causal attention: 2 x T x heads x
  head_dim per token and layer forward (QK^T and PV over half the keys on average), three times that with the
  backward. An MoE model's parameters count as its active ones (k experts of E per token), and so do the LoRA
  adapters of its routed experts (`routed_adapters` of the trainable ones). Remat's recomputation is not counted: a
  lower bound on the work."""
  import numpy as np
  tokens, t = int(np.prod(tokens_shape)), int(tokens_shape[-1])
  embed = 0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.hidden_size
  idle = model_cfg.num_params() - model_cfg.num_params(active=True)  # experts a token does not use
  share = 1 - model_cfg.experts_per_token / model_cfg.num_experts if model_cfg.num_experts else 0
  trainable_idle = idle if trainable_params == params_total else int(routed_adapters * share)
  dense = 4 * (params_total - embed - idle) + 2 * max(trainable_params - embed - trainable_idle, 0)
  # q . k over head_dim, p . v over the value heads' size (an MLA model's differ)
  attention = 3 * model_cfg.num_layers * t * model_cfg.num_heads * (model_cfg.head_dim + model_cfg.v_dim)
  return float(tokens) * (dense + attention)


def _host_peak_rss() -> int | None:
  """This process's peak resident memory (VmHWM: of its own address space, unlike getrusage, which a forked
  process inherits from its parent), or None where /proc is not available."""
  try:
    for line in open("/proc/self/status", encoding="ascii"):
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def format_report(r: dict, hbm_gib: float = 0.0) -> str:
  gib = lambda x: f"{x / 2**30:8.2f} GiB" if x >= 2**30 else f"{x / 2**20:8.2f} MiB"
  b, t = r["bytes_per_device"], r.get("target")
  where = (f"{t['chip']} {t['topology']} ({t['chips']} chips), compiled for the TPU" if t else
           f"{r['devices']} devices")
  lines = [f"{r['task']} step on {where}, mesh {r['mesh']}: {r['params_total'] / 1e6:,.1f} M params "
           f"({r['trainable_params'] / 1e6:,.1f} M trainable); per device:",
           f"  parameters       {gib(b['params'])}", f"  optimizer state  {gib(b['optimizer_state'])}",
           f"  arguments        {gib(b['arguments'])}", f"  temporaries      {gib(b['temp'])}"]
  oom = r.get("out_of_memory")
  if oom:  # no executable, so no buffer schedule: the compiler's own account of why
    lines.append(f"  the TPU compiler ran out of memory: {oom['message']}" +
                 ("; its largest allocations:" if oom["largest"] else ""))
    lines += [f"    {gib(size)}  {shape}  {op[-100:]}" for size, shape, op in oom["largest"]]
  if t:
    lines.append(f"  peak             {gib(b['peak'])}" + ("  (at least: train state + program)" if oom else ""))
    lines.append(f"  step time >= {t['step_time_lower_bound_s']:.3f} s (lower bound: "
                 f"{t['model_flops_per_chip'] / 1e12:,.1f} TFLOPs of model FLOPs per chip at its bf16 peak)")
    hbm_gib = hbm_gib or t["hbm_gib"]
  else:
    lines.append(f"  peak (estimate)  {gib(b['peak_estimate'])}")
  if hbm_gib:
    fits = b.get("peak", b["peak_estimate"]) <= hbm_gib * 2**30
    lines.append(f"  {'fits' if fits else 'DOES NOT FIT'} in {hbm_gib:g} GiB per device")
    if not fits:
      lines.append("  " + advice(r, hbm_gib * 2**30)["text"])
  return "\n".join(lines)


def advice(r: dict, hbm_bytes: float) -> dict:
  """Which knob or mesh axis to grow when the step in report `r` does not fit in `hbm_bytes` per device:
  {"text", "overrides" (config keys to set), "estimate" (bytes)}. The estimate splits the peak in two: the train
  state (parameters and optimizer state), divided by the axes that share out the weights (fsdp, sequence), and the
  rest (activations, checkpoints, temporaries), proportional to the tokens a device holds in one pass: rows /
  (data x fsdp x expert x micro-batches), times tokens / sequence. Options that keep the chips come first: more
  micro-batches (fewer rows per pass), a data factor moved to fsdp; then the fewest extra chips, on sequence (both
  parts shrink) or on fsdp (the rest shrinks only while a device still has rows to give up)."""
  b, mesh = r["bytes_per_device"], r["mesh"]
  peak = b.get("peak", b["peak_estimate"])
  state = b["params"] + b["optimizer_state"]
  rest = max(peak - state, 0)
  micro = r.get("micro_batches", 1)
  rows = r["batch"]["tokens"][0] // (micro * mesh["data"] * mesh["fsdp"] * mesh["expert"])
  tokens = r["batch"]["tokens"][-1] // mesh["sequence"]
  size = lambda x: f"{x / 2**30:.2f} GiB" if x >= 2**30 else f"{x / 2**20:.2f} MiB"
  passes = "grpo.mini_batches" if r["task"] in ("grpo", "ppo") else "train.micro_batches"  # RL: each an update
  shape = lambda **grow: {"mesh.shape": tuple(mesh[a] * grow.get(a, 1) // grow.get("_" + a, 1)
                                              for a in ("data", "fsdp", "tensor", "expert", "sequence"))}
  same_chips, more_chips = [], []
  for k in (2, 4, 8, 16, 32, 64):
    options = [  # (list, applies, estimate, what, overrides)
        (same_chips, rows // k >= 1, state + rest / k, f"{passes} x{k} (rows per pass {rows} -> {rows // k})",
         {passes: micro * k}),
        (same_chips, mesh["data"] // k >= 1, state / k + rest, f"move {k}x from data to fsdp",
         shape(fsdp=k, _data=k)),
        (more_chips, tokens // k >= 128, (state + rest) / k,
         f"sequence {mesh['sequence']} -> {mesh['sequence'] * k} ({k}x the chips, {tokens // k} tokens per chip)",
         shape(sequence=k)),
        (more_chips, True, state / k + (rest / k if rows // k >= 1 else rest),
         f"fsdp {mesh['fsdp']} -> {mesh['fsdp'] * k} ({k}x the chips)", shape(fsdp=k))]
    for where, applies, estimate, what, overrides in options:
      if applies and estimate <= hbm_bytes:
        where.append({"text": f"to fit: {what}, estimated peak {size(estimate)}", "overrides": overrides,
                      "estimate": estimate})
  for found in (same_chips, more_chips):
    if found:
      return found[0]
  return {"text": f"to fit: no one axis up to 64x does (train state {size(state)}, the rest {size(rest)}); "
                  "shrink what is trained or kept: LoRA, model.remat=full, a shorter train.seq_len",
          "overrides": {}, "estimate": None}


def main(argv=None) -> int:
  argv = list(sys.argv if argv is None else argv)
  devices = next((int(a.split("=", 1)[1]) for a in argv if a.startswith("--devices=")), 0)
  if devices:  # before jax is imported: fake that many host devices
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if any(a.startswith("--topology=") for a in argv):  # see tpu_target.target
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from absl import app, flags
  from ml_collections import config_flags
  config = config_flags.DEFINE_config_file("config", None, "configs/<task>.py[:arg]", lock_config=True)
  flags.DEFINE_integer("devices", 0, "fake this many host devices (0 = the machine's own)")
  flags.DEFINE_string("topology", "", "compile for this TPU slice instead (v5p-8, v5e-8, v6e-8, v5p-64, v5e:2x2; "
                      "needs libtpu, not a TPU)")
  flags.DEFINE_enum("arch", "", [""] + sorted(ARCHS), "a preset model shape instead of model.path / model.arch")
  flags.DEFINE_float("hbm_gib", 0.0, "memory per device to compare against (e.g. 16 v5e, 95 v5p, 141 H200)")
  flags.DEFINE_string("json", "", "also write the report here")

  def run(_):
    import jax

    from jalign.config import validate
    from jalign.parallel import tpu_target
    target = tpu_target.target(flags.FLAGS.topology) if flags.FLAGS.topology else None
    cfg = validate(config.value, jax.device_count() if target is None else target.num_chips)
    r = report(cfg, flags.FLAGS.arch, target)
    r["host_peak_rss_bytes"] = _host_peak_rss()
    print(format_report(r, flags.FLAGS.hbm_gib))
    if flags.FLAGS.json:
      with open(flags.FLAGS.json, "w", encoding="utf-8") as f:
        json.dump(r, f, indent=1)

  app.run(run, argv=argv)
  return 0


if __name__ == "__main__":
  main()

