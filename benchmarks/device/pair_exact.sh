#!/bin/bash
# One GPU call (2026-12-08, issues 39 and 43): the pair stage's exact diagonal blocks in a second
# launch (staged_pair_kernel's EXACT; ptxas, sm_90a: rwkv7's first launch spills 100 bytes a thread
# where the one launch spilled 280, kda's 48 where it spilled 228) and comba's p gradient in
# staged_de (b40c1fe), both first run on a GPU here: each against the base commit's lrdsl
# (ab_base.sh's A/B, rwkv7 and comba at the short shape; .gpucache/base unpacked by the caller, e.g.
# from 88822e9), the GPU tests of the per-channel specs and of comba between its two rounds, then
# the first launch's warps and register caps (benchmarks/pair_sweep.py).
# usage (device machine, repository root, with the kit of README.md here):
#   SAVE_BINS=1 benchmarks/device/pair_exact.sh
BUDGET=${BUDGET:-560} source .gpucache/setup.sh
ab_round 1 4,4096,16,128,128 examples/rwkv7.lr examples/comba.lr
TAIL=10 g tests env LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0 python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider \
    --dist load tests/test_gpu.py tests/test_dplr.py -k "(comba or kda or rwkv or dplr or gla or oja or gdn2) and \
    (backward_bf16 or strong_decays or nonfinite_backward or finite_loads)"
ab_round 2 4,4096,16,128,128 examples/rwkv7.lr examples/comba.lr
TAIL=12 g sweep python3 benchmarks/pair_sweep.py --subs 32 --keys 64 --warps 4,8 --regs 0,128,168 \
    examples/rwkv7.lr examples/kda.lr
# what is left of the call: the segmented call at issue 43's long shape after 7989de7 and 59a6c98
TAIL=12 g segments python3 benchmarks/segments.py --specs gated_deltanet --shapes long --segments auto,1
ab_tables
