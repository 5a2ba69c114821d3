"""Cold start of a spec: seconds from lrdsl.compile to the end of the first call, in a fresh process.

Usage (device machine): python benchmarks/cold_start.py SPEC [SPEC ...] [--shape B,T,H,K,V] [--backward]
Each spec runs twice, each time in a process of its own: first with empty Triton and lrdsl caches
(parse, check, render, JIT, tune and one forward, or forward + backward with --backward, at the
bench shape, B=4 T=4096 H=16 K=V=128 unless --shape says otherwise), then again with the caches the
first process filled. The clock starts after `import torch, lrdsl`, which a user pays once.
"""
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import sys, time, torch, lrdsl
from lrdsl.bench import draw, parse_shape
spec, shape, backward = sys.argv[1], parse_shape(sys.argv[2]), sys.argv[3] == "1"
t0 = time.perf_counter()
m = lrdsl.compile(spec)
x = draw(m, shape)
if backward:
    x = {n: t.requires_grad_() if t.is_floating_point() else t for n, t in x.items()}
    m.chunk(**x)[0].float().sum().backward()
else:
    with torch.no_grad():
        m.chunk(**x)
torch.cuda.synchronize()
print(f"{time.perf_counter() - t0:.1f}")
"""


def run(spec: str, shape: str, backward: bool, cache: str) -> str:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"), XDG_CACHE_HOME=os.path.join(cache, "xdg"))
    r = subprocess.run([sys.executable, "-c", CHILD, spec, shape, "1" if backward else "0"], env=env,
                       capture_output=True, text=True)
    if r.returncode:
        return "failed: " + (r.stderr.strip().splitlines() or ["?"])[-1][:120]
    return r.stdout.strip().splitlines()[-1] + " s"


def main(argv):
    args = list(argv)
    shape = "4,4096,16,128,128"
    if "--shape" in args:
        i = args.index("--shape")
        shape = args[i + 1]
        del args[i:i + 2]
    backward = "--backward" in args
    specs = [a for a in args if not a.startswith("--")]
    if not specs:  # the usage, not silence
        sys.exit(__doc__.strip())
    print(f"| spec | shape | {'forward + backward' if backward else 'forward'}: cold | caches filled |")
    print("|---|---|---|---|")
    for spec in specs:
        with tempfile.TemporaryDirectory() as cache:
            cold = run(spec, shape, backward, cache)
            warm = run(spec, shape, backward, cache)
        print(f"| {os.path.basename(spec)[:-3]} | {shape} | {cold} | {warm} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
