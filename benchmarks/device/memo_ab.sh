#!/bin/bash
# One short GPU call (2026-12-07, after aef06f7; issue 43): host against wall time with and without
# the autotuners' remembered choices in one process (benchmarks/host_overhead.py --ab-memo: memo, no
# memo, memo again), then the segmented call's GPU tests (the finish on strided views) as far as the
# budget goes.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=100 benchmarks/device/memo_ab.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
TAIL=14 g host python3 benchmarks/host_overhead.py --cuda --ab-memo --shape 4,4096,16,128,128 --reps 20 \
    examples/linear_attention.lr examples/gated_deltanet.lr
LRDSL_AUTOTUNE=0 TAIL=6 g seg python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short -n 4 \
    tests/test_segments_gpu.py -k gated_deltanet
