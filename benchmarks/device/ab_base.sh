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
ab_round 1 $SHAPE "$@"
ab_round 2 $SHAPE "$@"
ab_tables
