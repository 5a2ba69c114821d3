#!/bin/bash
# One GPU call: every example with an FLA twin (and the novel examples) beside FLA at one shape,
# forward and forward + backward, on this checkout; rows are printed as each spec finishes.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=540 benchmarks/device/twins.sh [B,T,H,K,V] [SPEC ...]
source .gpucache/setup.sh
SHAPE=${1:-4,4096,16,128,128}; shift
SPECS=${*:-examples/gated_deltanet.lr examples/deltanet.lr examples/kda.lr examples/gla.lr examples/mamba2.lr
examples/linear_attention.lr examples/retnet.lr examples/gdn2.lr examples/precond_deltanet.lr examples/precond_kda.lr
examples/kda_decay_after_erase.lr examples/gdn2_atk.lr examples/channel_gates_scalar_decay.lr
examples/mesa_retention.lr examples/gated_deltanet_gates.lr}
TAIL=3 g twins_${SHAPE//,/_} $LR bench --backward --shape $SHAPE $SPECS
grep "^[0-9]* |" $OUT/logs/twins_${SHAPE//,/_}.txt | cut -d" " -f2- | cut -c1-400  # the table, last
