#!/bin/bash
# One GPU call (2026-12-07, issue 39; reordered 2026-12-08): comba after b40c1fe (p's gradient made in
# staged_de, plan.chain_at_dc): first the GPU tests that run comba's kernels and test_hf's FLA-layer
# cases (the kernels changed without a GPU run), then the A/B against a base commit's lrdsl
# (ab_base.sh, unpacked into .gpucache/base by the caller), then comba's kernels beside chunk_comba's
# one by one (profile_kernels.py --fla, forward + backward), then beside FLA at both of issue 39's
# shapes (twins_rwkv.py).
# usage (device machine, repository root, with the kit of README.md here; .gpucache/base as in
# ab_base.sh, e.g. from 88822e9):
#   benchmarks/device/comba_ab.sh
BUDGET=${BUDGET:-560} source .gpucache/setup.sh
TAIL=8 g tests env LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0 python3 -m pytest -m gpu -n 4 -q -p no:cacheprovider --dist load \
    tests/test_gpu.py tests/test_twins_rwkv.py \
    tests/test_hf.py -k "comba or fla_layer"
ab_round 1 4,4096,16,128,128 examples/comba.lr
ab_round 2 4,4096,16,128,128 examples/comba.lr
TAIL=60 g kernels python3 benchmarks/profile_kernels.py examples/comba.lr --backward --fla
TAIL=14 g twins python3 benchmarks/twins_rwkv.py --no-bounded --no-parts \
    --shapes "4,4096,16,128,128 1,16384,32,128,128" examples/comba.lr
ab_tables
