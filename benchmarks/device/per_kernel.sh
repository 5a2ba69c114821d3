#!/bin/bash
# One GPU call (2026-12-07; issues 39 and 43): each kernel's roofline (`lrdsl bench --per-kernel
# --backward --no-fla`: GPU time per kernel under torch.profiler, FLOPs and requested bytes counted by
# lrdsl.census with the tiles the autotuners chose), at B=4 T=4096 H=16 for the specs named (default
# rwkv7, comba and gated_deltanet); the per-kernel tables printed last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/per_kernel.sh [SPEC ...]
source .gpucache/setup.sh
SPECS=("$@"); [ ${#SPECS[@]} -eq 0 ] && SPECS=(examples/rwkv7.lr examples/comba.lr examples/gated_deltanet.lr)
TAIL=6 g per_kernel env $OLDNP $LR bench --backward --no-fla --per-kernel --shape 4,4096,16,128,128 "${SPECS[@]}"
grep -v "Warning\|warn(" $OUT/logs/per_kernel.txt | cut -d" " -f2- | sed -n '/per kernel/,$p'
