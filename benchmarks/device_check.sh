#!/usr/bin/env bash
# Accelerator check, one short run: the forward benchmark at GPU-sized shapes, bf16 and fp32.
# Usage: bash benchmarks/device_check.sh   (prints figures to stdout; needs jax with CUDA, torch, transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python -c "import jax; print('devices:', jax.devices())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python benchmarks/model_forward.py --hidden 2048 --layers 16 --vocab 32000 --batch 8 --seq 1024 --dtype bfloat16 --repeats 20
python benchmarks/model_forward.py --hidden 1024 --layers 8 --vocab 32000 --batch 8 --seq 512 --dtype float32 --repeats 20 --skip-peer
