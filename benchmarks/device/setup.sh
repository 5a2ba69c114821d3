# sourced first in every GPU call (repo root)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc; [ -f .gpucache/tc.tgz ] && tar xzf .gpucache/tc.tgz -C /tmp
LR="python3 -m lrdsl.cli"
savecache() { (cd /tmp && find tc -name '*.autotune.json' | tar czf $OUT/tc.tgz -T -); }
mkdir -p $OUT/logs
trap 'savecache; tar czf $OUT/logs.tgz -C $OUT logs 2>/dev/null; rm -rf $OUT/logs' EXIT
# g NAME CMD...: CMD within what is left of the call's BUDGET seconds (default 540), its output
# stamped with seconds since the call began, kept whole in $OUT/logs/NAME.txt, its last TAIL lines
# (default 15) printed, then its exit status
START=$(date +%s); END=$((START + ${BUDGET:-540}))
stamp() { while IFS= read -r l; do echo "$(( $(date +%s) - START )) $l"; done; }
g() {
    local n=$1; shift
    local left=$((END - $(date +%s) - 12))
    if [ $left -lt 20 ]; then echo "SKIP (no time): $*"; return; fi
    echo "=== $* (limit ${left}s)"
    timeout -s TERM $left "$@" 2>&1 | stamp > $OUT/logs/$n.txt
    local rc=${PIPESTATUS[0]}
    grep -v "^[0-9]* *$" $OUT/logs/$n.txt | grep -v "Warning\|warn(" | tail -${TAIL:-15}
    echo "rc=$rc"
}
