#!/bin/bash
# One GPU call after the readout's fp32 pairs (2123f04) and the sub-token rows without integer division
# (48ba4d8; issue 40): the GPU tests of oja, the value side and the products, delta_product2's
# kernels one by one, then delta_product2 and oja beside FLA, forward and forward + backward (the
# tables printed last).
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=400 benchmarks/device/product_division.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short"
LRDSL_AUTOTUNE=0 TAIL=12 g tests $P -n 8 --dist load tests/test_value_staged_gpu.py tests/test_twins_oja.py \
    tests/test_delta_product.py tests/test_gpu.py \
    -k "(oja or value or product) and not time_and_memory and not tiles_time and not staged_forward_time"
TAIL=2 g dp_prof python3 benchmarks/profile_kernels.py examples/delta_product2.lr --backward
TAIL=3 g dp_bench $LR bench --backward examples/delta_product2.lr
TAIL=3 g oja_bench $LR bench --backward examples/oja.lr
grep -v "at::native" $OUT/logs/dp_prof.txt | grep "| [0-9]* | [0-9.]* |" | cut -d" " -f2- | cut -c1-110
for f in dp_bench oja_bench; do grep "^[0-9]* |" $OUT/logs/$f.txt | cut -d" " -f2- | cut -c1-400; done  # the tables, last
