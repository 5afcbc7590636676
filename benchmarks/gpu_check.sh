#!/usr/bin/env bash
# GPU checks for a lent CUDA machine, in a few minutes (at most 7.5 with every timeout). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# 1. the codec's compiled kernels on CUDA (Triton, through inductor: the same source as on CPU) against the CPU ones
#    (`tests/test_gpu.py`: with a tolerance, bit for bit where the formats must agree, exact repeats on one device);
# 2. the hook's time per step on CUDA (tiny Llama, SmolLM2's LoRA adapters and its 135M full parameter set), at 8 bits
#    (the default), 4 and 2 bits; the first run compiles the kernels (printed; inductor's cache makes later runs fast);
# 3. the GPU's name, memory and power draw as NVML reports them (what the cost meter reads).
# Paste the printed figures into benchmarks/LOG.md with the date and the GPU's name.
set -euo pipefail
PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."

"$PYTHON" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA device: torch.cuda.is_available() is False.")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== 1. CUDA codec vs CPU codec (pytest -m gpu)"
timeout 180 "$PYTHON" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider

for bits in 8 4 2; do
    echo "== 2. hook time per step on CUDA, ${bits} bits"
    timeout 90 "$PYTHON" benchmarks/bench_hook_speed.py --device cuda --world_sizes 1 --bits "$bits" --large
done

echo "== 3. NVML"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,power.draw,utilization.gpu --format=csv
else
    echo "nvidia-smi not found: the cost meter falls back to its estimate"
fi
