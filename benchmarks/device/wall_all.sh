#!/bin/bash
# One GPU call (issue 43's "wall time within 5% of GPU time for every example's forward + backward"):
# benchmarks/host_overhead.py --cuda at B=4 T=4096 H=16 K=V=128 for the examples named (default: the
# first half of examples/, `HALF=2` the second), each in its own process so that one failure leaves
# the others; the rows last. About 30 s an example with the tuning records of .gpucache/tc.tgz.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/wall_all.sh [SPEC ...]
#   HALF=2 BUDGET=540 benchmarks/device/wall_all.sh
source .gpucache/setup.sh
SPECS=("$@")
if [ ${#SPECS[@]} -eq 0 ]; then
    ALL=(examples/*.lr); N=${#ALL[@]}; MID=$(( (N + 1) / 2 ))
    if [ "${HALF:-1}" = 2 ]; then SPECS=("${ALL[@]:$MID}"); else SPECS=("${ALL[@]:0:$MID}"); fi
fi
for s in "${SPECS[@]}"; do
    n=$(basename $s .lr)
    TAIL=2 g wall_$n python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 $s
done
cat $OUT/logs/wall_*.txt | cut -d" " -f2- | grep "\.lr " | sort
