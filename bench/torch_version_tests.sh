#!/usr/bin/env bash
# The CPU tests on the GPU machine's image, for its torch (2.11; this repository's CI runs 2.13). CUDA is
# hidden: the ranks are gloo processes on CPU, as in CI.
#     OUT=DIR bash bench/torch_version_tests.sh        # those that lean on torch internals: Inductor's
#         compile order between peer ranks (torch.compile backend wrapper, AOTAutograd's eager
#         backward), the fork server's ranks, the stage lookup on a Hugging Face model
#     OUT=DIR bash bench/torch_version_tests.sh all    # every test CI runs
set -uo pipefail
source "$(dirname "$0")/stage_package.sh"
python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
if [ "${1:-}" = all ]; then
    cd tests && CUDA_VISIBLE_DEVICES= python -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/torch_version_all_tests.txt"
else
    cd tests && CUDA_VISIBLE_DEVICES= python -m pytest -q -p no:cacheprovider test_compile_once.py passes/test_units.py \
        test_launch.py -k "not dead_rank" 2>&1 | tee "$OUT/torch_version_tests.txt"
fi
