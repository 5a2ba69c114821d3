# sourced first in every GPU call (repo root)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
mkdir -p /tmp/tc; [ -f .gpucache/tc.tgz ] && tar xzf .gpucache/tc.tgz -C /tmp
LR="python3 -m lrdsl.cli"
savecache() { (cd /tmp && find tc -name '*.autotune.json' | tar czf $OUT/tc.tgz -T -); }
mkdir -p $OUT/logs
trap 'savecache; tar czf $OUT/logs.tgz -C $OUT logs 2>/dev/null; rm -rf $OUT/logs' EXIT
