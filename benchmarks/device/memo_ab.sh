#!/bin/bash
# One GPU call (2026-12-07, after 1335ca4; issue 43): host against wall time with and without the
# autotuners' remembered choices in one process (benchmarks/host_overhead.py --ab-memo: memo, no
# memo, memo again), the segmented call's GPU tests (its finish on strided views and its maps
# composed in one walk: tests/test_segments_gpu.py, and test_gpu.py's bf16 backward in segments), then gated_deltanet at B=1 T=65536 with four
# heads and with two key heads of four value heads each, in the schedule's choice, one pass and 8 segments,
# beside FLA (benchmarks/segments.py); tables last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/memo_ab.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
TAIL=14 g host python3 benchmarks/host_overhead.py --cuda --ab-memo --shape 4,4096,16,128,128 --reps 20 \
    examples/linear_attention.lr examples/gated_deltanet.lr
LRDSL_AUTOTUNE=0 TAIL=6 g seg_tests python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short -n 4 \
    tests/test_segments_gpu.py tests/test_gpu.py -k "segments"
TAIL=4 g seg python3 benchmarks/segments.py --specs gated_deltanet --shapes long,gva --segments auto,1,8
grep "^[0-9]* |" $OUT/logs/seg.txt | cut -d" " -f2-
