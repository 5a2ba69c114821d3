#!/bin/bash
# One GPU call: benchmarks/segments.py (issue 43): gated_deltanet, kda and gla with and without
# segmented state passes beside FLA's chunk ops, forward and forward + backward, GPU time; rows are
# printed as they come, the table last. Each new segment count autotunes afresh: a cold call fits
# about one spec at all four shapes.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/segments.sh [SPECS] [SHAPES] [SEGMENTS]
#   e.g. benchmarks/device/segments.sh gated_deltanet long,gva auto,1,8,16,32,64
source .gpucache/setup.sh
SPECS=${1:-gated_deltanet,kda,gla}; SHAPES=${2:-long,gva,std4,std1}; SEGMENTS=${3:-auto,1,8,16,32,64}
NAME=segments_${SPECS//,/_}_${SHAPES//,/_}
TAIL=3 g $NAME python3 benchmarks/segments.py --specs $SPECS --shapes $SHAPES --segments $SEGMENTS
grep "^[0-9]* |" $OUT/logs/$NAME.txt | cut -d" " -f2-  # the table, last
