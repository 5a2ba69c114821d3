#!/bin/bash
# One GPU call (2026-12-07, after 8da3091; issue 43): the segmented call's finish on strided views
# (affine._Finish) and the autotuners' remembered choices (tuning.remember_choices), both host code:
# the GPU tests they touch (segments, forward + backward in a CUDA graph, no synchronising call, the
# tuning plumbing, every example's bf16 backward), then host against wall time of four mixers at the
# standard shape (benchmarks/host_overhead.py --cuda) and gated_deltanet at B=1 T=65536 H=4 in the
# schedule's segments and in one pass beside FLA (benchmarks/segments.py); tables last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=330 benchmarks/device/finish_memo.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
LRDSL_AUTOTUNE=0 TAIL=6 g tests timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short -n 6 \
    --dist load tests/test_segments_gpu.py tests/test_decode_gpu.py tests/test_gpu.py \
    -k "segments or schedule or graph or synchronising or autotuning or tuning_space or compiles_its_kernels or backward_bf16"
TAIL=10 g host python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 \
    examples/linear_attention.lr examples/gated_deltanet.lr examples/deltanet.lr examples/kda.lr
TAIL=4 g seg python3 benchmarks/segments.py --specs gated_deltanet --shapes long --segments auto,1
grep "^[0-9]* |" $OUT/logs/seg.txt | cut -d" " -f2-
