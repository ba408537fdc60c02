#!/usr/bin/env bash
# The GPU-only tests on one H200: bf16 Hugging Face models through parallelize in three compile modes
# (tests/test_hf_gpu.py), the rotary-table dtypes (tests/test_precision_tables.py) and the Triton
# kernels against their CPU references (tests/kernels).
#     OUT=DIR bash bench/gpu_tests.sh
# The package is staged under /tmp/pkg (bench/stage_package.sh).
set -uo pipefail
source "$(dirname "$0")/stage_package.sh"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
cd tests && python -m pytest -q -p no:cacheprovider test_hf_gpu.py test_precision_tables.py kernels 2>&1 | tee "$OUT/gpu_tests.txt"
