#!/bin/bash
# One GPU call (2026-12-07; issue 43's wall within 5% of GPU time): what the host waits on in a
# forward + backward at B=4 T=4096 H=16. First the CUDA calls and torch operations of one step under
# torch.profiler (host_overhead.py --cuda --api: a synchronising call or an allocator miss shows as a
# long call), then host / wall / GPU of five examples with the autotuners' memo (the loader's default
# since 2026-12-07), in a fresh process and in one whose first act is a profiler session
# (--profiler-first: lrdsl bench times its walls after such sessions); tables last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/host_wait.sh
source .gpucache/setup.sh
SH=4,4096,16,128,128
for s in linear_attention retnet gated_deltanet; do
    TAIL=1 g api_$s python3 benchmarks/host_overhead.py --cuda --api --top 14 --shape $SH examples/$s.lr
done
ALL="examples/linear_attention.lr examples/retnet.lr examples/mamba2.lr examples/gated_deltanet.lr examples/deltanet.lr"
TAIL=7 g fresh python3 benchmarks/host_overhead.py --cuda --shape $SH --reps 20 $ALL
TAIL=7 g after python3 benchmarks/host_overhead.py --cuda --profiler-first --shape $SH --reps 20 $ALL
for s in linear_attention retnet gated_deltanet; do grep -v -i "warn" $OUT/logs/api_$s.txt | cut -d" " -f2- | tail -34; done
