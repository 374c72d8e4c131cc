"""TPU as a compile target on this CPU host (libtpu from the test extra): accelerator types map to Cloud TPU's slice
shapes, programs compile for the TPU devices and report the chip's memory, and the fit check compiles a task's real
step for a slice."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jalign import fit
from jalign.parallel import tpu_target
from tests.configs_util import run_config


@pytest.mark.parametrize("name, topology, chips", [
    ("v5p-8", "v5:2x2x1", 4),         # v5p counts TensorCores: 8 cores = 4 chips
    ("v5p-64", "v5:2x4x4", 32),
    ("v5e-8", "v5e:2x4", 8),          # v5e / v6e count chips
    ("v5litepod-16", "v5e:4x4", 16),
    ("v6e-8", "v6e:2x4", 8),
    ("v4-8", "v4:2x2x1", 4),
    ("v5e:2x2", "v5e:2x2", 4),        # a libtpu topology name as is
])
def test_accelerator_types_map_to_cloud_slices(name, topology, chips):
  chip, got = tpu_target.parse(name)
  assert got == topology
  t = tpu_target.target(name)
  assert t.num_chips == chips and t.topology == topology
  assert {d.platform for d in t.devices} == {"tpu"}
  assert {d.device_kind for d in t.devices} == {chip.device_kind}


@pytest.mark.parametrize("name, message", [
    ("v3-8", "GEN one of v4, v5e, v5p, v6e"), ("v5p-7", "two per chip"), ("v5e-6", "power-of-two"),
    ("v5e:2x2x1", "2 dimensions"), ("tpu", "expected an accelerator type"),
])
def test_bad_targets_say_what_is_accepted(name, message):
  with pytest.raises(ValueError, match=message):
    tpu_target.parse(name)


def test_a_program_compiles_for_the_tpu_with_its_hbm_figures():
  t = tpu_target.target("v5e-4")
  mesh = jax.sharding.Mesh(t.devices, ("x",))
  x = jax.ShapeDtypeStruct((2048, 4096), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  compiled = jax.jit(lambda a: jnp.tanh(a @ a.T).sum(0)).lower(x).compile()
  mem = compiled.memory_analysis()
  assert mem.argument_size_in_bytes == 2048 * 4096 * 4 // 4  # one row shard per chip
  assert mem.peak_memory_in_bytes >= mem.argument_size_in_bytes
  assert t.seconds_at_peak(197e12) == pytest.approx(1.0)


def test_fit_report_compiles_the_task_step_for_a_slice():
  r = fit.report(run_config("sft", mesh__shape=(1, 4, 1)), target=tpu_target.target("v5e-4"))
  assert r["target"]["chip"] == "TPU v5e" and r["target"]["chips"] == 4 and r["devices"] == 4
  b = r["bytes_per_device"]
  assert b["peak"] >= b["arguments"] > 0
  # Model FLOPs by hand for the tiny config: tokens x (6 x matmul params + 6 x layers x T x heads x head_dim).
  cfg = run_config("sft", mesh__shape=(1, 4, 1))
  arch, (b_, t_) = cfg.model.arch, (cfg.train.batch_size, cfg.train.seq_len)
  matmul = r["params_total"] - (0 if arch.tie_embeddings else arch.vocab_size * arch.hidden_size)
  want = b_ * t_ * (6 * matmul + 6 * arch.num_layers * t_ * arch.num_heads * arch.head_dim)
  assert r["target"]["model_flops_per_chip"] * 4 == pytest.approx(want)
  assert r["target"]["step_time_lower_bound_s"] == pytest.approx(want / 4 / 197e12)
  assert "compiled for the TPU" in fit.format_report(r) and "fits in 16 GiB" in fit.format_report(r)


def _fit_sft_at_8k_on_v5p_8(tmp_path, arch: str):
  """`python -m jalign.fit` as jalign/fit.py's doc runs it: an SFT step of `arch`, one 8192-token sequence per chip,
  bf16, full remat, compiled for TPU v5p-8 (4 chips, FSDP over them): (its --json report, its stdout)."""
  import json
  import os
  import subprocess
  import sys

  from tests.configs_util import ROOT
  out = tmp_path / "fit.json"
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  proc = subprocess.run(
      [sys.executable, "-m", "jalign.fit", "--config=configs/sft.py", f"--arch={arch}", "--topology=v5p-8",
       "--config.mesh.shape=(1,4,1)", "--config.model.dtype=bfloat16", "--config.model.remat=full",
       "--config.train.batch_size=4", "--config.train.seq_len=8192", f"--json={out}"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


@pytest.mark.long  # CI time: the fit command and its compiled step: tests/test_fit.py and the tiny steps here
def test_llama3_8b_sft_at_8k_tokens_fits_a_v5p_8(tmp_path):
  """The command of jalign/fit.py's doc: a Llama-3-8B SFT step, one 8192-token sequence per chip, bf16,
  full remat, compiled for TPU v5p (4 chips, FSDP over them) with splash attention and the Pallas log-prob kernel
  (auto picks both for a TPU): it fits the chip's 95 GiB (and uses under half of it)."""
  r, stdout = _fit_sft_at_8k_on_v5p_8(tmp_path, "llama3-8b")
  assert r["target"]["chip"] == "TPU v5p" and r["target"]["chips"] == 4
  b = r["bytes_per_device"]
  assert b["params"] == pytest.approx(8_030_261_248 * 2 / 4, rel=0.01)
  assert b["peak"] < 0.5 * 95 * 2**30
  assert "fits in 95 GiB per device" in stdout
  # 6 x 8.03e9 x 8192 matmul FLOPs plus attention, per chip, at 459 TFLOP/s: about 0.9 s at the least.
  assert 0.8 < r["target"]["step_time_lower_bound_s"] < 1.1


@pytest.mark.long  # CI time; the Llama-3-8B slice compile stays in the default run
def test_qwen3_30b_a3b_sft_at_8k_tokens_fits_a_v5p_8(tmp_path):
  """The MoE preset: Qwen3-30B-A3B (128 experts, top 8) SFT, one 8192-token sequence per chip, bf16, full remat,
  compiled for TPU v5p (4 chips, FSDP over them): the experts run the Mosaic grouped matmul inside shard_map (the
  compile fails otherwise: Mosaic kernels are not partitioned automatically), all 30.5 B parameters are held and the
  step-time bound counts the 3.35 B active ones."""
  r, stdout = _fit_sft_at_8k_on_v5p_8(tmp_path, "qwen3-30b-a3b")
  b = r["bytes_per_device"]
  assert b["params"] == pytest.approx(30_532_122_624 * 2 / 4, rel=0.01)
  assert b["peak"] < 95 * 2**30 and "fits in 95 GiB per device" in stdout
  # Per token 6 x (3.353e9 active - 0.311e9 embedding) + 6 x 48 x 8192 x 32 x 128 (attention), 8192 tokens per
  # chip, at 459 TFLOP/s: about 0.5 s at the least.
  assert 0.45 < r["target"]["step_time_lower_bound_s"] < 0.55


def test_a_step_the_tpu_compiler_refuses_is_reported_with_its_largest_allocations_and_advice():
  """Dense (`xla`) attention over 16k tokens: its fp32 scores alone are over a v5e chip's 16 GiB, and the TPU
  compiler refuses the program. The report carries the compiler's figures (the program's need, the chip's capacity)
  and the advice to grow an axis, instead of an exception; the older error form with its list of allocations reads
  the same."""
  cfg = run_config("sft", mesh__shape=(1, 4, 1), model__attention="xla", train__seq_len=16384,
                   data__max_length=16384)
  r = fit.report(cfg, target=tpu_target.target("v5e-4"))
  oom = r["out_of_memory"]
  assert oom["message"].startswith("Ran out of memory on HBM, the total memory required for HLO temporaries")
  # one row of 16k tokens per chip: the scores of a layer's heads alone, fp32, are heads x 1 GiB
  assert oom["program"] > 16 * 2**30 and oom["capacity"] == int(15.75 * 2**30)
  b = r["bytes_per_device"]
  assert b["peak"] == b["params"] + b["optimizer_state"] + oom["program"]
  text = fit.format_report(r)
  assert "the TPU compiler ran out of memory" in text and "DOES NOT FIT in 16 GiB" in text
  assert fit.advice(r, 16 * 2**30)["text"] in text

  older = fit.out_of_memory(
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 21.95G of "
      "15.48G hbm. Exceeded hbm capacity by 6.47G.\n\nTotal hbm usage >= 22.47G:\n    reserved        530.00M\n"
      "    program          21.95G\n    arguments            0B\n\n  Largest program allocations in hbm:\n\n"
      "  1. Size: 2.00G\n     Operator: op_name=\"jit(step)/attn/dot_general\"\n     Shape: f32[32,4096,4096]\n"
      "     Allocation type: HLO temp\n     ==========================\n")
  assert older["program"] == int(21.95 * 2**30) and older["capacity"] == int(15.48 * 2**30)
  assert older["largest"] == [(2 * 2**30, "f32[32,4096,4096]", "jit(step)/attn/dot_general")]
  assert fit.out_of_memory("INTERNAL: something else") is None
