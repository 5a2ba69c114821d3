#!/bin/bash
# One GPU call: DeltaProduct (delta_product2, delta_product3) beside FLA
# at issue 40 shapes, forward and forward + backward, GPU time
# and peak extra memory (benchmarks/twins_product.py); the table printed last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/twins_product.sh ["B,T,H,K,V ..."] [SPEC ...]
# Both shapes and every FLA op's first tuning may not fit one call: pass one shape per call.
source .gpucache/setup.sh
SHAPES=${1:-"4,4096,16,128,128 1,16384,32,128,128"}; shift
TAIL=3 g twins_product python3 benchmarks/twins_product.py --shapes "$SHAPES" "$@"
grep -v "^[0-9]* *$" $OUT/logs/twins_product.txt | grep "^[0-9]* \(bf16\||\)" | cut -d" " -f2- | cut -c1-400  # the table, last
