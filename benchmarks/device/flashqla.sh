#!/bin/bash
# FlashQLA beside lrdsl and FLA (issue 43): gated_deltanet at the long few-head shapes and the two
# standard ones, forward and forward + backward, GPU time (benchmarks/segments.py --flashqla). Its
# wheels (tilelang alone is 49.6 MB) exceed one call's carry with the kit, so it takes two calls on
# one warm machine, each installing into /tmp/site, which the machine keeps while it is held:
#   run(command="bash benchmarks/device/flashqla.sh install", carry=[".whl_qla1"])
#   run(command="BUDGET=500 bash benchmarks/device/flashqla.sh", carry=[".whl", ".gpucache", ".whl_qla2"])
# (.whl_qla1: tilelang; .whl_qla2: flash_qla, z3-solver, apache-tvm-ffi, torch-c-dlpack-ext, cloudpickle,
# ml-dtypes, psutil; benchmarks/device/README.md says how to download them). The table is printed last.
# TileLang compiles FlashQLA's kernels for about 150 s per shape (H100, 2026-12-06): one shape a call,
# the long one unless SHAPES names others (long, gva, std4, std1).
if [ "$1" = "install" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_qla1/*.whl
    echo "installed: $(ls /tmp/site | grep -i tilelang | head -3 | tr '\n' ' ')"
    exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_qla2/*.whl || exit 1
source .gpucache/setup.sh
TAIL=6 g flashqla_import python3 -c "import flash_qla, tilelang; print('flash_qla', flash_qla.__version__, 'tilelang', tilelang.__version__)"
NAME=flashqla
TAIL=3 g $NAME python3 benchmarks/segments.py --specs gated_deltanet --shapes ${SHAPES:-long} \
    --segments auto --flashqla
grep "^[0-9]* |" $OUT/logs/$NAME.txt | cut -d" " -f2-  # the table, last
