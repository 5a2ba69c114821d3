#!/bin/bash
# One short GPU call (2026-12-07 after 0094d8e; issues 39 and 43): decode's step in a CUDA graph with
# the wide rule for many sequences (tests/test_decode_gpu.py) and kda's and gated_deltanet's step at
# B=256 by the module's own choice beside FLA (benchmarks/decode_sweep.py's "plan" rows), then rwkv7's
# staged_pair_kernel over key slices, warps and register caps (benchmarks/pair_sweep.py), then
# delta_product2's finite loads against the copies at the long shape, kernel by kernel
# (benchmarks/finite_loads_cost.py), then host against wall time of the small mixers after the
# grouped flag and fill launches (ba37907; benchmarks/host_overhead.py --cuda), where linear_attention's
# host time goes (cProfile with real launches) and gated_deltanet's kernels in 8 segments at B=1
# T=65536 H=4 (benchmarks/profile_kernels.py; logs only); tables last.
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=560 benchmarks/device/pair_decode.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
LRDSL_AUTOTUNE=0 TAIL=6 g dec python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=line tests/test_decode_gpu.py -k "step or wide"
TAIL=4 g sweep python3 benchmarks/decode_sweep.py --batches 256 --bv 32 --warps 1 examples/kda.lr examples/gated_deltanet.lr
TAIL=4 g pair python3 benchmarks/pair_sweep.py --keys 16,32,64 --warps 4,8 --regs 0,128 examples/rwkv7.lr
TAIL=4 g finite python3 benchmarks/finite_loads_cost.py --shape 1,16384,32,128,128 examples/delta_product2.lr
TAIL=12 g host python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 examples/linear_attention.lr examples/gated_deltanet.lr
TAIL=2 g hostprof python3 benchmarks/host_overhead.py --cuda --profile both --reps 20 --top 40 --shape 4,4096,16,128,128 examples/linear_attention.lr
TAIL=2 g segprof python3 benchmarks/profile_kernels.py --backward --shape 1,65536,4,128,128 examples/gated_deltanet.lr
grep "^[0-9]* |" $OUT/logs/sweep.txt | cut -d" " -f2-
grep "^[0-9]* |" $OUT/logs/pair.txt | cut -d" " -f2-
grep -v "^[0-9]* *$" $OUT/logs/finite.txt | grep "^[0-9]* \(delta\||\)" | cut -d" " -f2- | cut -c1-200
