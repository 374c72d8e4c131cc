"""Fit figures on TPU slices, compiled on this host: per-chip HBM and a lower bound on the step time of Llama-3
SFT, DPO and GRPO steps at long contexts (`jalign.fit` with a `tpu_target`; libtpu, no TPU).

Each case is the task's real train step (the builder `python -m jalign.run` uses), bf16 parameters and Adam moments,
full remat, attention and log-probs as `auto` picks them for a TPU (splash, pallas_tpu), one sequence (SFT, GRPO) or
one pair (DPO) per chip and update. The step time is model FLOPs at the chip's bf16 peak (`fit.model_flops`).

  python benchmarks/tpu_fit.py                 # the tables of benchmarks/README.md (~30 minutes on 2 cores)
  python benchmarks/tpu_fit.py --only=sft      # a subset: cases whose name contains this
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def _config(task: str, chips: int, tokens: int, mesh: tuple[int, ...], lora_rank: int = 0):
  """configs/<task>.py with the long-context overrides (one sequence or pair per chip; `mesh`'s data x fsdp x
  expert rows), LoRA adapters of `lora_rank` if given."""
  from jalign.config import validate
  spec = importlib.util.spec_from_file_location(f"configs_{task}", os.path.join(ROOT, "configs", f"{task}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config(None).to_dict()
  c["model"].update(dtype="bfloat16", remat="full", scan_layers=True)
  c["model"]["lora"]["rank"] = lora_rank
  c["mesh"]["shape"] = mesh
  rows = mesh[0] * mesh[1] * (mesh[3] if len(mesh) > 3 else 1)
  if task == "grpo":  # groups of 8 samples; one mini-batch of `rows` completions, prompt 1/8 of the length
    c["sampling"].update(num_samples=8, max_prompt_length=tokens // 8, max_new_tokens=tokens - tokens // 8)
    c["grpo"].update(prompts_per_step=max(1, rows // 8), mini_batches=max(1, 8 // rows), compact_sizes=0)
  else:
    c["train"].update(batch_size=rows, seq_len=tokens, micro_batches=1)
    c["data"]["max_length"] = tokens  # the fit check's batch holds examples as long as the run takes them
  return validate(c, chips)


# (name, task, arch, accelerator type, tokens, mesh (data, fsdp, tensor[, expert[, sequence]])[, LoRA rank])
CASES = [(f"{task} 8b {acc} {t // 1024}k", task, "llama3-8b", acc, t, (1, chips, 1))
         for acc, chips in (("v5p-8", 4), ("v6e-8", 8)) for task in ("sft", "dpo", "grpo")
         for t in (4096, 8192, 32768)]
# One 32k-token pair per chip does not fit a v6e's 32 GiB: a pair over two chips (tensor parallel) does.
CASES += [("dpo 8b v6e-8 32k tp2", "dpo", "llama3-8b", "v6e-8", 32768, (1, 4, 2))]
# Or over two chips of a `sequence` axis (context parallelism: ring attention, activations split along the tokens).
CASES += [("dpo 8b v6e-8 32k cp2", "dpo", "llama3-8b", "v6e-8", 32768, (1, 4, 1, 1, 2))]
# Long reasoning traces over a `sequence` axis: Llama-3-8B GRPO at 64k tokens on a v5p-8 (4 chips) and at 128k on a
# v5p-16 (8 chips); a Qwen3-8B-shaped DPO at 32k on a v5e-8 (16 GiB chips).
CASES += [("grpo 8b v5p-8 64k cp2", "grpo", "llama3-8b", "v5p-8", 65536, (1, 2, 1, 1, 2)),
          ("grpo 8b v5p-16 128k cp4", "grpo", "llama3-8b", "v5p-16", 131072, (1, 2, 1, 1, 4)),
          ("dpo qwen3-8b v5e-8 32k cp8", "dpo", "qwen3-8b", "v5e-8", 32768, (1, 1, 1, 1, 8)),
          ("dpo qwen3-8b v5e-8 32k cp4 tp2", "dpo", "qwen3-8b", "v5e-8", 32768, (1, 1, 2, 1, 4)),
          # LoRA (rank 16, all-linear): no full-size gradients or Adam moments, the reference is the base
          ("dpo qwen3-8b v5e-8 32k cp8 lora", "dpo", "qwen3-8b", "v5e-8", 32768, (1, 1, 1, 1, 8), 16)]
CASES += [(f"grpo 70b v5p-64 {t // 1024}k", "grpo", "llama3-70b", "v5p-64", t, (1, 8, 4)) for t in (4096, 8192)]
# MoE (Qwen3-MoE shapes, 128 experts, top 8) at 8k tokens: experts gathered like dense weights (FSDP) against split
# over an `expert` axis (expert parallelism, the fourth mesh size).
CASES += [(f"{task} 30b-a3b {acc} 8k{' ep' if len(mesh) > 3 else ''}", task, "qwen3-30b-a3b", acc, 8192, mesh)
          for task in ("sft", "grpo") for acc, chips in (("v5p-8", 4), ("v6e-8", 8))
          for mesh in ((1, chips, 1), (1, 1, 1, chips))]
CASES += [(f"{task} 30b-a3b v6e-8 8k lora{' ep' if len(mesh) > 3 else ''}", task, "qwen3-30b-a3b", "v6e-8", 8192, mesh,
           16) for task in ("sft", "grpo") for mesh in ((1, 8, 1), (1, 1, 1, 8))]
CASES += [(f"grpo 235b-a22b v5p-64 8k{' ep' if len(mesh) > 3 else ''}", "grpo", "qwen3-235b-a22b", "v5p-64", 8192,
           mesh) for mesh in ((1, 32, 1), (1, 4, 1, 8), (1, 2, 1, 16))]
# gpt-oss-20b (32 experts, top 4; attention sinks, so `chunked` attention in place of splash)
CASES += [(f"grpo gpt-oss-20b v5p-8 8k{' ep' if len(mesh) > 3 else ''}", "grpo", "gpt-oss-20b", "v5p-8", 8192, mesh)
          for mesh in ((1, 4, 1), (1, 1, 1, 4))]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--only", default="", help="run the cases whose name contains this")
  args = parser.parse_args()
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jalign import fit
  from jalign.parallel import tpu_target
  print(f"{'case':28s} {'mesh':>9s} {'params':>8s} {'optim':>8s} {'peak':>8s} {'HBM':>6s} {'fits':>5s} "
        f"{'step >=':>8s} {'compile':>8s}")
  for name, task, arch, acc, tokens, mesh, *lora_rank in CASES:
    if args.only not in name:
      continue
    target = tpu_target.target(acc)
    start = time.perf_counter()
    try:
      r = fit.report(_config(task, target.num_chips, tokens, mesh, *lora_rank), arch, target)
    except Exception as e:  # noqa: BLE001  out of memory at compile time is a result too
      print(f"{name:28s} {'x'.join(map(str, mesh)):>9s} failed: {str(e).splitlines()[0][:120]}", flush=True)
      continue
    b, t = r["bytes_per_device"], r["target"]
    if "out_of_memory" in r:
      oom = r["out_of_memory"]
      print(f"{name:28s} {'x'.join(map(str, mesh)):>9s} {oom['message']}; largest: " + ", ".join(
          f"{size / GIB:.2f}G {shape}" for size, shape, _ in oom["largest"][:3]), flush=True)
    print(f"{name:28s} {'x'.join(map(str, mesh)):>9s} {b['params'] / GIB:7.2f}G {b['optimizer_state'] / GIB:7.2f}G "
          f"{b['peak'] / GIB:7.2f}G {t['hbm_gib']:5.0f}G {'yes' if b['peak'] <= t['hbm_gib'] * GIB else 'NO':>5s} "
          f"{t['step_time_lower_bound_s']:7.3f}s {time.perf_counter() - start:7.0f}s", flush=True)
    gc.collect()


if __name__ == "__main__":
  main()
