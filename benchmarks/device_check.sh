#!/usr/bin/env bash
# Accelerator check in one short run (a few minutes on one GPU or TPU chip, no network): log-prob kernels (xla,
# chunked, the chip's Pallas kernel), attention (xla, chunked, cudnn / splash), one SFT and one GRPO step of a ~1B-parameter model (MFU), and the sampler's
# decode rate against the HBM-bandwidth bound. Figures go to a JSON file (see benchmarks/device_check.py).
#
#   bash benchmarks/device_check.sh [--smoke] [--out FILE] [--only SECTION...]
#
# --smoke: tiny shapes on any backend (CI runs it on CPU). Needs jax (with the chip's plugin), flax, optax, grain
# and ml_collections; jalign itself is used from this checkout. Where any is missing, wheels placed in
# benchmarks/wheels/ (grain also needs array_record and portpicker) are installed offline first. Exit status 1 when any section recorded an error.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
if ! "$PY" -c "import jax, flax, optax, grain, ml_collections" 2>/dev/null && compgen -G "benchmarks/wheels/*.whl" >/dev/null; then
  "$PY" -m pip install --no-index --no-deps benchmarks/wheels/*.whl
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
fi
exec "$PY" benchmarks/device_check.py "$@"
