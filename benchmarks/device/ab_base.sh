#!/bin/bash
# One GPU call: lrdsl's GPU times at one shape (forward, forward + backward, `lrdsl bench --no-fla`)
# with a base commit's lrdsl package (python -P: not the working directory's) and with this
# checkout's, alternately, in one call on one GPU; the tables printed last. The caller unpacks the
# base before the call (.gpucache travels):
#   rm -rf .gpucache/base && mkdir -p .gpucache/base && git archive REV lrdsl | tar -x -C .gpucache/base
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=300 benchmarks/device/ab_base.sh B,T,H,K,V SPEC ...
source .gpucache/setup.sh
SHAPE=$1; shift
for round in 1 2; do
    TAIL=2 g base_$round env PYTHONPATH=/tmp/site:$PWD/.gpucache/base python3 -P -m lrdsl.cli bench --backward --no-fla --shape $SHAPE "$@"
    TAIL=2 g head_$round $LR bench --backward --no-fla --shape $SHAPE "$@"
done
for n in base_1 head_1 base_2 head_2; do echo "== $n"; grep "^[0-9]* |" $OUT/logs/$n.txt | cut -d" " -f2- | cut -c1-300; done
