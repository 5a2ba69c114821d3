#!/bin/bash
# One GPU call (2026-12-07): the GPU tests that run the per-channel staged backward's pair stage
# (every mixer with a decay per key channel: its bf16 gradients, strong decays, every staged config,
# non-finite inputs; test_dplr's and test_twins_rwkv's GPU tests), warm from .gpucache's compiled
# kernels; each test's result printed as it ends (-v), the summary last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=360 benchmarks/device/pair_tests.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0
K="(backward or strong or every_staged or nonfinite) and (kda or gla or rwkv or dplr or gdn2 or oja)"
TAIL=30 g pair_tests python3 -m pytest -m gpu -p no:cacheprovider -v --dist load -rfE --tb=short -n 12 \
    tests/test_gpu.py tests/test_dplr.py tests/test_twins_rwkv.py -k "$K or sum_order or twin or fla"
