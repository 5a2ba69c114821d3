#!/bin/bash
# One GPU call (2026-12-08, issues 39 and 43): the pair stage's exact diagonal blocks in a second
# launch (staged_pair_kernel's EXACT; ptxas, sm_90a: rwkv7's first launch spills 100 bytes a thread
# where the one launch spilled 280, kda's 48 where it spilled 228) and comba's p gradient in
# staged_de (b40c1fe), both first run on a GPU here: the GPU tests of the per-channel specs and of
# comba, then each against the base commit's lrdsl (ab_base.sh's A/B, rwkv7 and comba at the short
# shape; .gpucache/base unpacked by the caller, e.g. from 88822e9), then the first launch's warps
# and register caps (benchmarks/pair_sweep.py).
# usage (device machine, repository root, with the kit of README.md here):
#   SAVE_BINS=1 benchmarks/device/pair_exact.sh
BUDGET=${BUDGET:-560} source .gpucache/setup.sh
TAIL=10 g tests env LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0 python3 -m pytest -m gpu -n 6 -q -p no:cacheprovider \
    --dist load tests/test_gpu.py tests/test_dplr.py -k "(comba or kda or rwkv or dplr or gla or oja or gdn2) and \
    (backward_bf16 or strong_decays or nonfinite_backward or finite_loads)"
for round in 1 2; do
    TAIL=3 g base_$round env PYTHONPATH=/tmp/site:$PWD/.gpucache/base python3 -P -m lrdsl.cli bench --backward --no-fla \
        --shape 4,4096,16,128,128 examples/rwkv7.lr examples/comba.lr
    TAIL=3 g head_$round $LR bench --backward --no-fla --shape 4,4096,16,128,128 examples/rwkv7.lr examples/comba.lr
done
TAIL=12 g sweep python3 benchmarks/pair_sweep.py --subs 32 --keys 64 --warps 4,8 --regs 0,128,168 \
    examples/rwkv7.lr examples/kda.lr
for n in base_1 head_1 base_2 head_2; do echo "== $n"; grep "^[0-9]* |" $OUT/logs/$n.txt | cut -d" " -f2- | cut -c1-300; done
