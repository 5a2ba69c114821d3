#!/bin/bash
# One GPU call (issue 40; 2026-12-06 after af16769): delta_product2 and oja beside FLA at B=1 T=16384
# H=32 K=V=128, forward and forward + backward, then (unless DP3=0) delta_product3 beside FLA at B=4
# T=4096 H=16 (benchmarks/twins_product.py), and with SUITE=1 the whole `-m gpu` suite on one GPU in
# what is left (test_cp_gpu needs two; since 2026-12-07 after the tables, which a budget cut short
# would lose); the tables printed last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 [SUITE=1] [DP3=0] benchmarks/device/long_products.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short"
TAIL=3 g long $LR bench --backward --shape 1,16384,32,128,128 examples/delta_product2.lr examples/oja.lr
[ "${DP3:-1}" = 1 ] && TAIL=3 g dp3 python3 benchmarks/twins_product.py --shapes 4,4096,16,128,128 examples/delta_product3.lr
if [ "${SUITE:-0}" = 1 ]; then
    LRDSL_AUTOTUNE=0 TAIL=12 g suite $P -n 8 --dist load tests/test_gpu.py tests/test_decode_gpu.py \
        tests/test_delta_product.py tests/test_dplr.py tests/test_hf.py tests/test_nn.py tests/test_segments_gpu.py \
        tests/test_twins_oja.py tests/test_twins_rwkv.py tests/test_value_staged_gpu.py tests/test_value_bwd_gpu.py \
        tests/test_two_sided_gpu.py -k "not tiles_time"
fi
grep "^[0-9]* |" $OUT/logs/long.txt | cut -d" " -f2- | cut -c1-400
[ -f $OUT/logs/dp3.txt ] && grep -v "^[0-9]* *$" $OUT/logs/dp3.txt | grep "^[0-9]* \(bf16\||\)" | cut -d" " -f2- | cut -c1-400
