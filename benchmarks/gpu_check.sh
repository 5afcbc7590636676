#!/usr/bin/env bash
# GPU checks for a lent CUDA machine, in a few minutes (at most 8.5 with every timeout). Run from the repository root:
#
#     bash benchmarks/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter
#
# 1. the codec's compiled kernels on CUDA (Triton, through inductor: the same source as on CPU) against the CPU ones
#    (`tests/test_gpu.py`: with a tolerance, bit for bit where the formats must agree, exact repeats on one device),
#    and the codec's properties over every magnitude on CUDA (hypothesis; subnormal blocks, one gradient then zeros);
# 2. the hook's time per step on CUDA (tiny Llama, SmolLM2's LoRA adapters and its 135M full parameter set), at 8 bits
#    (the default), 4 and 2 bits; the first run compiles the kernels (printed; inductor's cache makes later runs fast);
# 3. the GPU's name, memory and power draw as NVML reports them (what the cost meter reads).
# 4. GRPOTrainer on the Trainer's FSDP2 (fsdp_config={"version": 2}, then accelerate launch with
#    recipes/accelerate/fsdp2.yaml) and on DeepSpeed ZeRO-2 (recipes/accelerate/ds_zero2.json): train 12 steps,
#    checkpoint at 6, resume, one PASS/FAIL line per check (benchmarks/gpu_engines.py). One process per GPU (NCCL);
#    with 2+ GPUs the FSDP2 runs also check GRPO's compressed reduce-scatter. Needs `pip install deepspeed` for ZeRO-2.
# 5. with 4+ GPUs, the sync every H steps between replica groups through the Trainer's own path (issue 45): Accelerate's
#    FSDP plugin with ParallelismConfig(dp_replicate_size=2, dp_shard_size=N/2) (HSDP, which GRPOTrainer turns into
#    replica groups), grpo_sync_every=4, θ_global in pinned CPU memory; trained, checkpointed at 6 and resumed
#    (benchmarks/gpu_engines.py fsdp2-replicas). The pinned θ_global's bits against θ_global on the GPU are in step 1.
# Paste the printed figures into benchmarks/LOG.md with the date and the GPU's name.
set -euo pipefail
PYTHON="${PYTHON:-python}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the workers import benchmarks.* and tests.testing_utils

"$PYTHON" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA device: torch.cuda.is_available() is False.")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
PY

echo "== 1. CUDA codec vs CPU codec (pytest -m gpu)"
timeout 240 "$PYTHON" -m pytest -m gpu tests/test_gpu.py -q -p no:cacheprovider

for bits in 8 4 2; do
    echo "== 2. hook time per step on CUDA, ${bits} bits"
    timeout 90 "$PYTHON" -m benchmarks.bench_hook_speed --device cuda --world_sizes 1 --bits "$bits" --large
done

echo "== 3. NVML"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,memory.used,power.draw,utilization.gpu --format=csv
else
    echo "nvidia-smi not found: the cost meter falls back to its estimate"
fi

NGPU="$("$PYTHON" -c 'import torch; print(min(torch.cuda.device_count(), 2))')"
OUT="$(mktemp -d)"
echo "== 4. GRPOTrainer on FSDP2 and DeepSpeed ZeRO-2, ${NGPU} GPU(s)"
timeout 240 "$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU" benchmarks/gpu_engines.py fsdp2 "$OUT/fsdp2"
timeout 240 "$PYTHON" -m accelerate.commands.launch --config_file recipes/accelerate/fsdp2.yaml \
    --num_processes "$NGPU" benchmarks/gpu_engines.py fsdp2-accelerate "$OUT/fsdp2-accelerate"
if "$PYTHON" -c 'import deepspeed' 2>/dev/null; then
    timeout 240 "$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU" benchmarks/gpu_engines.py zero2 "$OUT/zero2"
else
    echo "deepspeed is not installed (pip install deepspeed): ZeRO-2 check skipped"
fi

NGPU_ALL="$("$PYTHON" -c 'import torch; n = torch.cuda.device_count(); print(n - n % 2)')"
if [ "$NGPU_ALL" -ge 4 ]; then
    echo "== 5. the sync between replica groups: 2 replicas x $((NGPU_ALL / 2)) GPUs (Accelerate's FSDP plugin, dp_replicate_size=2)"
    timeout 300 "$PYTHON" -m torch.distributed.run --nproc_per_node "$NGPU_ALL" benchmarks/gpu_engines.py fsdp2-replicas \
        "$OUT/fsdp2-replicas"
else
    echo "== 5. replica groups need 4 GPUs or more (this machine has $("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')): skipped"
fi
