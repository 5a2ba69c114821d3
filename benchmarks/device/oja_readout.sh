#!/bin/bash
# One GPU call for oja's readout on tensor cores (templates/chunk_value_out.py.jinja, 2026-12-06,
# 140e797; issue 40): oja alone with its per-kernel table, the GPU suite (tests/test_gpu.py, then the
# other GPU files; neither the time_and_memory sweeps nor the readout and staged-forward timings),
# then oja beside FLA's chunk_gated_oja_rule, forward and forward + backward (the tables printed last).
# usage (device machine, repository root, with the kit of README.md here):
#   BUDGET=585 benchmarks/device/oja_readout.sh
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda
P="python3 -m pytest -m gpu -p no:cacheprovider -q -rf --tb=short"
TAIL=3 g oja_bench $LR bench --backward --no-fla --per-kernel examples/oja.lr
LRDSL_AUTOTUNE=0 TAIL=25 g gpu_main $P -n 8 --dist load tests/test_gpu.py -k "not time_and_memory"
LRDSL_AUTOTUNE=0 TAIL=25 g gpu_rest $P -n 8 --dist load tests/test_decode_gpu.py tests/test_delta_product.py \
    tests/test_dplr.py tests/test_hf.py tests/test_nn.py tests/test_segments_gpu.py tests/test_twins_oja.py \
    tests/test_twins_rwkv.py tests/test_value_staged_gpu.py tests/test_value_bwd_gpu.py tests/test_two_sided_gpu.py \
    -k "not time_and_memory and not tiles_time and not staged_forward_time"
TAIL=3 g oja_fla $LR bench --backward examples/oja.lr
for f in oja_bench oja_fla; do grep "^[0-9]* |" $OUT/logs/$f.txt | cut -d" " -f2- | cut -c1-400; done  # the tables, last
