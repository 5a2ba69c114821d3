#!/bin/bash
# The `-m gpu` suite on one GPU in parts that each fit a call (2026-12-07: the whole of it but
# test_cp_gpu (two GPUs) and test_two_sided_gpu (out of memory beside seven other workers) ran into
# a 560 s call's limit twice on a fresh H100, 108 and 132 of 183 tests done: pyproject's
# `--dist loadgroup` put every test of test_gpu.py on one worker, for its module-scoped table (now
# session-scoped; other GPU files keep module fixtures), so the suite runs with `--dist load` here,
# each test's result printed as it ends). PART=k of PARTS takes
# the k-th contiguous slice of the collected tests (parametrisations of one test stay together, so
# they share compiles); PART=two_sided runs that file alone on two workers. SAVE_BINS=1 (the
# default here) returns the compiled kernels with the tuning records (setup.sh), so a later call on
# a fresh machine starts warm: copy every returned tcbin.part* into .gpucache/ beside tc.tgz.
# usage (device machine, repository root, with the kit of README.md here):
#   PART=1 PARTS=3 [WORKERS=8] BUDGET=540 benchmarks/device/gpu_suite.sh
export SAVE_BINS=${SAVE_BINS:-1}
source .gpucache/setup.sh
export LRDSL_TEST_DEVICE=cuda LRDSL_AUTOTUNE=0
PYTEST="python3 -m pytest -m gpu -p no:cacheprovider -v --dist load -rfE --tb=short --durations=12"
if [ "${PART:-1}" = two_sided ]; then
    TAIL=25 g two_sided $PYTEST -n 2 tests/test_two_sided_gpu.py
    exit
fi
FILES="tests/test_gpu.py tests/test_decode_gpu.py tests/test_delta_product.py tests/test_dplr.py tests/test_hf.py
       tests/test_nn.py tests/test_segments_gpu.py tests/test_twins_oja.py tests/test_twins_rwkv.py
       tests/test_value_staged_gpu.py tests/test_value_bwd_gpu.py"
python3 -m pytest -m gpu -p no:cacheprovider -q --collect-only -n 0 $FILES -k "not tiles_time" 2>/dev/null | grep "::" > /tmp/ids
N=$(wc -l < /tmp/ids); P=${PARTS:-3}; K=${PART:-1}
sed -n "$(( (K - 1) * N / P + 1 )),$(( K * N / P ))p" /tmp/ids > /tmp/part
echo "part $K of $P: $(wc -l < /tmp/part) of $N tests"
TAIL=25 g suite_$K $PYTEST -n ${WORKERS:-8} $(cat /tmp/part)
