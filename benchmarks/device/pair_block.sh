#!/bin/bash
# One GPU call (2026-12-07; issue 39's rwkv7 and dplr, issue 43's per-channel decays): the per-channel
# staged backward's pair stage over its block size (plan.staged_pair_sub: 16, 32, 64 tokens; each
# block reloads the chunk's tiles, docs/kernels.md "What each kernel moves"), key slices, warps and
# register caps (benchmarks/pair_sweep.py) for rwkv7 and kda, then each kernel's roofline of rwkv7
# and comba (`lrdsl bench --per-kernel`); tables last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/pair_block.sh
source .gpucache/setup.sh
TAIL=3 g pair_rwkv7 python3 benchmarks/pair_sweep.py --subs 16,32,64 --keys 32,64 --warps 4,8 --regs 0,128 examples/rwkv7.lr
TAIL=3 g pair_kda python3 benchmarks/pair_sweep.py --subs 16,32,64 --keys 32,64 --warps 4 --regs 0,128 examples/kda.lr
TAIL=3 g per_kernel env $OLDNP $LR bench --backward --no-fla --per-kernel --shape 4,4096,16,128,128 examples/rwkv7.lr examples/comba.lr
for n in pair_rwkv7 pair_kda; do grep "^[0-9]* |" $OUT/logs/$n.txt | cut -d" " -f2-; done
grep -v "Warning\|warn(" $OUT/logs/per_kernel.txt | cut -d" " -f2- | sed -n '/per kernel/,$p'
