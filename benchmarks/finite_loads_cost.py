"""The staged backward with finite loads (runtime/nonfinite.FINITE_AT_LOAD, since 6562bde) against
the finite copies it replaced, on the same inputs: forward + backward GPU time, extra memory, and
each kernel's GPU time in both (the kernels whose time moved, largest change first).

Usage (device machine): python benchmarks/finite_loads_cost.py [--shape B,T,H,K,V] SPEC [SPEC ...]
delta_product2's forward + backward at B=1 T=16384 H=32 went from 8.811 ms (e550030) to 9.451
(13e1e70) on an H100 with 0.63 GiB less memory; this says which kernels took the difference. The
tables are printed last.
"""
import sys

from script_args import option

import lrdsl
from lrdsl.bench import draw, measure, parse_shape
from lrdsl.runtime import nonfinite


def main(argv) -> None:
    args = list(argv)
    shape = parse_shape(option(args, "--shape", "4,4096,16,128,128"))
    if not args:
        sys.exit(__doc__.strip())
    tables = []
    for spec in args:
        mixer = lrdsl.compile(spec)
        x = draw(mixer, shape)
        runs = {}
        for at_load in (False, True):
            nonfinite.FINITE_AT_LOAD = at_load
            runs[at_load] = measure(lambda t: mixer.chunk(**t)[0], x, shape, backward=True, per_kernel=True)
            print(mixer.name, "finite loads" if at_load else "copies", runs[at_load]["both_gpu_ms"], flush=True)
        nonfinite.FINITE_AT_LOAD = True
        copies, loads = runs[False], runs[True]
        per = {}
        for which, r in (("copies", copies), ("loads", loads)):
            for name, ms, n in r["both_kernels"]:
                per.setdefault(name[:60], {})[which] = (ms, n)
        rows = sorted(per.items(), key=lambda kv: -abs(kv[1].get("loads", (0, 0))[0] - kv[1].get("copies", (0, 0))[0]))
        lines = [f"{mixer.name}, B,T,H,K,V = {shape}: forward + backward GPU ms copies {copies['both_gpu_ms']:.3f}, "
                 f"finite loads {loads['both_gpu_ms']:.3f}; extra GiB {copies['bwd_mem'] / 2**30:.2f}, "
                 f"{loads['bwd_mem'] / 2**30:.2f}",
                 "| kernel | copies ms (launches) | finite loads ms (launches) |", "|---|---|---|"]
        for name, both in rows:
            cells = [f"{both[w][0]:.3f} ({both[w][1]:g})" if w in both else "-" for w in ("copies", "loads")]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
        tables.append("\n".join(lines))
    print("\n\n".join(tables))


if __name__ == "__main__":
    main(sys.argv[1:])
