"""The roofline of RESULTS.md's table "Where each model stands": for each row's lrdsl GPU times
(forward, forward + backward), the nominal FLOPs and bytes of lrdsl/roofline.py (counted from the
plan of this checkout) as TFLOP/s and GB/s, and their share of the row's GPU's dense bf16 peak and
memory bandwidth (H100 where the row says so, else the table's H200). No GPU needed: the times are
the table's own, so each figure is as old as its row's "measured" column.

    python3 benchmarks/roofline_table.py [RESULTS.md]   (prints a markdown table)
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def rows(text: str):
    """(example name, (B, T, H), device, fwd ms or None, f+b ms or None, measured) of the table."""
    head = text.split("## Log")[0].split("### Roofline of the table")[0]  # (this script's own table)
    for line in head.splitlines():
        if not line.startswith("| ") or line.startswith("| model") or line.startswith("|---"):
            continue
        c = [x.strip() for x in line.strip().strip("|").split("|")]
        if len(c) < 8 or not re.fullmatch(r"\d+,\d+,\d+", c[1]):
            continue
        name = re.match(r"[a-z0-9_]+", c[0]).group(0)
        fwd, both = (re.match(r"([\d.]+) /", x) for x in (c[2], c[4]))
        yield (name, tuple(int(v) for v in c[1].split(",")), "H100" if "H100" in c[0] else "H200",
               float(fwd.group(1)) if fwd else None, float(both.group(1)) if both else None, c[7])


def main(argv=None) -> int:
    import lrdsl
    from lrdsl.bench import Shape
    from lrdsl.roofline import cells, flop, nbytes, peak_of, rates
    path = (argv or sys.argv[1:] or [os.path.join(ROOT, "benchmarks", "RESULTS.md")])[0]
    out = ["| example | B,T,H | GPU | fwd ms | TFLOP/s | GB/s | % bf16 peak | % bandwidth | f+b ms | TFLOP/s | "
           "GB/s | % bf16 peak | % bandwidth | measured |", "|" + "---|" * 14]
    mixers = {}
    for name, (B, T, H), gpu, fwd, both, measured in rows(open(path).read()):
        spec = os.path.join(ROOT, "examples", f"{name}.lr")
        if not os.path.exists(spec) or (fwd is None and both is None):
            continue
        m = mixers.setdefault(name, lrdsl.compile(spec))
        s, peak = Shape(B=B, T=T, H=H, K=128, V=128), peak_of(gpu)
        cols = []
        for ms, backward in ((fwd, False), (both, True)):
            cols += ["-"] * 5 if ms is None else [f"{ms:.3f}", *cells(rates(flop(m, s, backward), nbytes(m, s, backward),
                                                                             ms, peak))]
        out.append(f"| {name} | {B},{T},{H} | {gpu} | " + " | ".join(cols) + f" | {measured} |")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
