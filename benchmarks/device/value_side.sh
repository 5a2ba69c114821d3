#!/bin/bash
# One GPU call for the value side and two-sided M S N (issue 40; their kernels of 2026-12-06,
# 1e05cd9 and 1301416, had not run on a GPU): the GPU tests of oja and of the two-sided spec, the
# tile and checkpoint sweeps of their backward kernels (tests/test_value_bwd_gpu.py and
# tests/test_two_sided_gpu.py print them; set VALUE_BWD_BK, VALUE_BWD_BT, VALUE_FWD_BK,
# TWO_SIDED_BWD_BT and TWO_SIDED_BWD_WARPS from them), then oja beside FLA's chunk_gated_oja_rule,
# forward and forward + backward (the table printed last).
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=560 benchmarks/device/value_side.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short"
TAIL=12 g value_tests $P -n 4 --dist load tests/test_twins_oja.py tests/test_gpu.py -k "oja or two_sided or msn"
TAIL=40 g value_sweeps $P -s -n 0 tests/test_value_bwd_gpu.py tests/test_two_sided_gpu.py
TAIL=3 g oja_bench $LR bench --backward examples/oja.lr
grep "^[0-9]* |" $OUT/logs/oja_bench.txt | cut -d" " -f2- | cut -c1-400  # the table, last
