#!/bin/bash
# One GPU call (2026-12-07, issue 39; not run yet: no GPU was lent that evening): comba after b40c1fe
# (p's gradient made in staged_de, plan.chain_at_dc) against a base commit's lrdsl (ab_base.sh,
# unpacked into .gpucache/base by the caller), then beside FLA at both of issue 39's shapes
# (twins_rwkv.py), then the GPU tests that run comba's kernels and test_hf's FLA-layer cases.
# usage (device machine, repository root, with the kit of README.md here; .gpucache/base as in
# ab_base.sh, e.g. from 88822e9):
#   benchmarks/device/comba_ab.sh
BUDGET=200 bash benchmarks/device/ab_base.sh 4,4096,16,128,128 examples/comba.lr
BUDGET=330 source .gpucache/setup.sh
TAIL=14 g twins python3 benchmarks/twins_rwkv.py --no-bounded --no-parts \
    --shapes "4,4096,16,128,128 1,16384,32,128,128" examples/comba.lr
TAIL=8 g tests python3 -m pytest -m gpu -n 4 -q tests/test_gpu.py tests/test_twins_rwkv.py tests/test_hf.py \
    -k "comba or fla_layer"
