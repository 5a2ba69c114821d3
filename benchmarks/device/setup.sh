# sourced first in every GPU call (repo root)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
# FLA's layers (flash-linear-attention) make `import fla` load fla.models, which needs transformers
# 5.6 or later: where that fails, the oracle's ops stay importable without them (test_hf's GPU cases skip)
python3 -c "import fla" 2>/dev/null || { echo "FLA's layers do not import here: left out"; rm -rf /tmp/site/fla/layers /tmp/site/fla/models; }
mkdir -p /tmp/tc; [ -f .gpucache/tc.tgz ] && tar xzf .gpucache/tc.tgz -C /tmp
# compiled kernels of an earlier call (SAVE_BINS=1 there): a cold compile of the GPU suite's kernels
# took most of a 560 s call on a fresh machine (2026-12-07)
ls .gpucache/tcbin.part* >/dev/null 2>&1 && cat .gpucache/tcbin.part* | tar xzf - -C /tmp
LR="python3 -m lrdsl.cli"
# Triton's interpreter (lrdsl.census, which `lrdsl bench --per-kernel` runs) fails with the image's
# numpy 2.4 (triton#9171; 2026-12-07): a command run as `g NAME env $OLDNP CMD...` takes numpy<2.4
# from .whl/np (the rest of the call keeps the image's)
[ -d .whl/np ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/np .whl/np/*.whl
OLDNP="PYTHONPATH=/tmp/np:$PYTHONPATH"
savecache() {
    (cd /tmp && find tc -name '*.autotune.json' | tar czf $OUT/tc.tgz -T -)
    [ "${SAVE_BINS:-0}" = 1 ] && savebins
}
# Triton loads a cached kernel from its .json files and its binary alone (runtime/cache.py's
# get_group keeps the files that exist), so the IRs stay behind; four parts of 15 MiB at most, as
# many as the call's returned files allow beside tc.tgz and logs.tgz
savebins() {
    (cd /tmp && find tc \( -name '*.cubin' -o -name '*.json' \) ! -name '*.autotune.json' | tar czf /tmp/bins.tgz -T -)
    local mb=$(( $(stat -c %s /tmp/bins.tgz) / 1048576 ))
    if [ $mb -lt 50 ]; then split -b 15m -d -a 2 /tmp/bins.tgz $OUT/tcbin.part; echo "compiled kernels: ${mb} MiB saved"
    else echo "compiled kernels: ${mb} MiB, too many to return; not saved"; fi
}
mkdir -p $OUT/logs
# a second script of the same call keeps the first one's logs (logs_1.tgz, ...; 2026-12-07: host_wait.sh's
# were overwritten by per_kernel.sh's in one call)
logname() { local f=$OUT/logs.tgz n=1; while [ -e $f ]; do f=$OUT/logs_$n.tgz; n=$((n + 1)); done; echo $f; }
trap 'savecache; tar czf $(logname) -C $OUT logs 2>/dev/null; rm -rf $OUT/logs' EXIT
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
# ab_round N B,T,H,K,V SPEC...: round N of an A/B, `lrdsl bench --backward --no-fla` with the base
# commit's lrdsl (.gpucache/base, python -P: not the working directory's), then this checkout's;
# ab_tables: every round's tables, printed last (ab_base.sh)
ab_round() {
    local r=$1 shape=$2; shift 2
    TAIL=3 g base_$r env PYTHONPATH=/tmp/site:$PWD/.gpucache/base python3 -P -m lrdsl.cli bench --backward --no-fla \
        --shape $shape "$@"
    TAIL=3 g head_$r $LR bench --backward --no-fla --shape $shape "$@"
}
ab_tables() {
    for n in base_1 head_1 base_2 head_2; do
        [ -f $OUT/logs/$n.txt ] && { echo "== $n"; grep "^[0-9]* |" $OUT/logs/$n.txt | cut -d" " -f2- | cut -c1-300; }
    done
}
