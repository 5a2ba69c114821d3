#!/bin/bash
# One GPU call after staged_dk's chain-rule epilogue took its order from codegen/chain_order.py and
# the product's sub-mixer its sub-token rows from row0's token (2026-12-06, branch dkchain; issues
# 39 and 43): the bf16 GPU tests of the examples whose staged_dk ends in the chain rule, then the
# per-kernel GPU time of their forward + backward (staged_dk's and staged_dr's rows printed last;
# before: comba's staged_dk 0.51 ms against gated_deltanet's 0.32 ms on an H100).
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=400 benchmarks/device/dkchain.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short"
TAIL=12 g tests $P -n 8 --dist load tests/test_gpu.py tests/test_delta_product.py \
    -k "(backward_bf16 or forward_bf16 or product) and (comba or deltanet or gated_deltanet or delta_product)"
TAIL=2 g prof python3 benchmarks/profile_kernels.py examples/comba.lr examples/gated_deltanet.lr \
    examples/gated_deltanet_gates.lr examples/delta_product2.lr --backward
grep -E "forward \+ backward|staged_d[kr]_kernel" $OUT/logs/prof.txt | cut -c1-140  # the rows, last
