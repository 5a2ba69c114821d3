"""docs/kernels.md's census table: for each spec, forward + backward at B=4 T=4096 H=16 K=V=128,
its launches, tensor-core GFLOP, roofline.py's nominal GB, the least GB its kernels move and the GB
they ask for (lrdsl.census, each kernel's first config), and its three kernels that move the most.
CPU only (Triton's interpreter; about a minute for the largest specs).

    python3 benchmarks/census_table.py [SPEC ...]   (default: every example; prints a markdown table)
"""
from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def row(path: str, s) -> str:
    import lrdsl
    from lrdsl import census, roofline
    both = census.of(path, s, True)["both"]
    mixer = lrdsl.compile(path)
    launches = sum(c.launches for c in both.values())
    least = sorted(both.items(), key=lambda kv: -kv[1].unique_bytes)[:3]
    top = ", ".join(f"{n.removesuffix('_kernel')} {c.unique_bytes / 1e9:.2f} / {(c.load_bytes + c.store_bytes) / 1e9:.2f}"
                    for n, c in least)
    return (f"| {os.path.basename(path)[:-3]} | {launches:.0f} | {sum(c.flop for c in both.values()) / 1e9:.0f} | "
            f"{roofline.nbytes(mixer, s, backward=True) / 1e9:.2f} | "
            f"{sum(c.unique_bytes for c in both.values()) / 1e9:.2f} | "
            f"{sum(c.load_bytes + c.store_bytes for c in both.values()) / 1e9:.2f} | {top} |")


def main(argv: list) -> int:
    from lrdsl.bench import Shape
    specs = argv or sorted(glob.glob(os.path.join(ROOT, "examples", "*.lr")))
    s = Shape(4, 4096, 16, 128, 128)
    print("| example | launches | GFLOP | GB nominal | GB at least | GB asked | largest: GB at least / asked |")
    print("|---|---|---|---|---|---|---|")
    for path in specs:
        print(row(path, s), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
