#!/bin/bash
# One GPU call after the split's in-place route and the staged backward's finite loads (2026-12-07,
# 372865b; issues 39 and 43, not run on a GPU when committed): their GPU tests and the bf16 forward and
# backward of the specs whose kernels changed, then rwkv7 and comba timed alone (lrdsl bench
# --no-fla: FLA's first tuning of chunk_rwkv7 and chunk_comba would not fit a small call), the table
# printed last. Beside FLA: benchmarks/device/twins_rwkv.sh.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=230 benchmarks/device/split_finload.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=line"
LRDSL_AUTOTUNE=0 TAIL=25 g tests timeout 120 $P -n 11 --dist load tests/test_gpu.py \
    -k "split_in_place or finite_loads or (backward_bf16 and (rwkv7 or comba or gated_deltanet or kda or dplr or delta_product2))"
TAIL=4 g bench $LR bench --backward --no-fla examples/rwkv7.lr examples/comba.lr
grep "^[0-9]* |" $OUT/logs/bench.txt | cut -d" " -f2- | cut -c1-300
