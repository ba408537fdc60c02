#!/usr/bin/env bash
# One H200 call for the partial offload: the 9.07e9-parameter GPT of bench/offload_gpu.py with the
# planner's offload="auto" (exact update), full offload beside it, then offload="auto" with
# offload_delay=1, each in its own process (each builds the model on the GPU).
#     OUT=DIR bash bench/gpu_offload_auto.sh
set -uo pipefail
source "$(dirname "$0")/stage_package.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
for args in "--offload auto" "--offload optimizer" "--offload auto --delay 1"; do
    echo "== $args"
    timeout 240 python bench/offload_gpu.py --layers 44 --steps 4 $args 2>&1 | tail -9
done
