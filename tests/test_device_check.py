"""benchmarks/device_check.sh --smoke: the accelerator check runs end to end on CPU at tiny shapes and writes its
JSON, so the script the team runs on a lent chip is known to work before the chip is there."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.long  # CI time: the kernels it times: tests/kernels
def test_device_check_smoke(tmp_path):
  out = tmp_path / "figures.json"
  env = {**os.environ, "PYTHON": sys.executable}
  proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "device_check.sh"), "--smoke", "--out", str(out)],
                        env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads(out.read_text())
  assert report["smoke"] is True and report["backend"] == "cpu"
  sections = report["sections"]
  assert set(sections) == {"logprobs", "attention", "sft_step", "grpo_step", "decode", "ragged_decode"}
  assert "error" not in json.dumps(sections)
  for impl in ("xla", "chunked", "pallas_gpu"):
    entry = sections["logprobs"][impl]
    assert entry["seconds"] > 0 and entry["tflops"] > 0 and entry["temp_bytes"] > 0
    assert max(entry["max_abs_diff_vs_xla"].values()) < 1e-4
  for impl in ("xla", "chunked", "splash"):  # splash interpreted off a TPU
    entry = sections["attention"][impl]
    assert entry["seconds"] > 0 and entry["tflops"] > 0 and entry["temp_bytes"] >= 0
    assert max(entry["max_rel_diff_vs_xla"].values()) < 0.05  # bf16
  for name in ("sft_step", "grpo_step"):
    assert sections[name]["tokens_per_s"] > 0 and sections[name]["params"] > 0
  assert sections["decode"]["tokens_per_s"] > 0 and sections["decode"]["bytes_per_decode_step"] > 0
  ragged = sections["ragged_decode"]  # the GPU kernel interpreted off a GPU
  assert ragged["xla"]["seconds"] > 0 and ragged["pallas_gpu"]["seconds"] > 0 and ragged["max_abs_diff"] < 0.05
