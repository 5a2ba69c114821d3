#!/bin/bash
# One GPU call for issue 43: the CUDA-graph tests (tests/test_decode_gpu.py: forward + backward and
# step captured and replayed, no synchronising call), the decode bench (step at T = 1 in a CUDA graph
# beside FLA's fused recurrent ops, and a T = 4 verification step with its rollback), wall vs GPU
# time of forward + backward per example (benchmarks/host_overhead.py --cuda) with the backward's
# non-finite guard on the device (the default) and read back (--nonfinite host), and the roofline and
# per-kernel tables of lrdsl bench; the decode table printed last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/decode.sh [SPEC ...]
source .gpucache/setup.sh
SPECS=${*:-examples/gated_deltanet.lr examples/kda.lr}
TAIL=8 g decode_gpu_tests env LRDSL_TEST_DEVICE=cuda python3 -m pytest -p no:cacheprovider -q -n 0 -m gpu tests/test_decode_gpu.py
TAIL=3 g decode $LR bench --decode $SPECS
TAIL=8 g host_overhead python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 \
    examples/gated_deltanet.lr examples/deltanet.lr examples/kda.lr examples/gla.lr examples/mamba2.lr
TAIL=4 g host_overhead_hostguard python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 \
    --nonfinite host examples/gated_deltanet.lr examples/kda.lr
TAIL=14 g roofline $LR bench --backward --per-kernel --no-fla examples/gated_deltanet.lr
grep "^[0-9]* |" $OUT/logs/decode.txt | cut -d" " -f2- | cut -c1-300  # the decode table, last
