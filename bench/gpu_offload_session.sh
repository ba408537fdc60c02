#!/usr/bin/env bash
# One H200 session for optimizer offload: the host's pinned-copy bandwidth and CPU AdamW rate
# (cost_model.calibrate), a small smoke run, then the ~9B-parameter model (bench/offload_gpu.py).
#     OUT=DIR bash bench/gpu_offload_session.sh
# The package is staged under /tmp/pkg (bench/stage_package.sh).
set -uo pipefail
source "$(dirname "$0")/stage_package.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2; nproc
(cd /tmp && python - <<'PY') 2>&1 | tee "$OUT/host_calibration.txt"
import torch
from autopar.cost_model.calibrate import measure_host_adam, measure_host_copies
for n in (2**28, 2**30):
    up, down = measure_host_copies(n)
    print(f"pinned copies of {n / 2**20:.0f} MiB: host->GPU {up / 1e9:.1f} GB/s, GPU->host {down / 1e9:.1f} GB/s")
for n in (2**26, 2**28):
    rate, kind = measure_host_adam(n)
    print(f"CPU AdamW ({kind}) over {n:.3g} fp32 parameters: {rate / 1e9:.2f}e9 parameters/s")
PY
python bench/offload_gpu.py --layers 2 --width 1024 --heads 8 --seq 1024 --batch 2 --steps 3 2>&1 | tail -8
for layers in 44 40; do
    echo "== ${layers} layers"
    if OUT="$OUT" python bench/offload_gpu.py --layers "$layers" 2>&1 | tail -12; then break; fi
done
