"""Forward and forward+backward time of a spec with the plan's causal_nonfinite on and off.

The chunked forward keeps non-finite inputs causal (a nan at token t leaves every earlier token
as the reference has it) by sanitising the operands of its triangular products; this prints what
that costs, on the same inputs, at the benchmark shape. GPU only:
    python3 benchmarks/nonfinite_cost.py examples/gated_deltanet.lr [SPEC ...]
"""
import dataclasses
import sys

import lrdsl
import lrdsl.codegen.plan as plan_module
from lrdsl.bench import draw, measure, parse_shape


def main(specs):
    shape = parse_shape("4,4096,16,128,128")
    base = plan_module.plan
    rows = []
    for spec in specs:
        for flag in (True, False):
            # generate() looks the plan function up at each compile; the cache key follows the source
            plan_module.plan = lambda m, f=flag: dataclasses.replace(base(m), causal_nonfinite=f)
            mixer = lrdsl.compile(spec)
            r = measure(lambda t: mixer.chunk(**t)[0], draw(mixer, shape), shape, True)
            rows.append((spec, flag, r["fwd_ms"], r["both_ms"]))
    plan_module.plan = base
    print(f"{'spec':32s} {'causal_nonfinite':>16s} {'fwd ms':>8s} {'f+b ms':>8s}")
    for spec, flag, fwd, both in rows:
        print(f"{spec:32s} {str(flag):>16s} {fwd:8.3f} {both:8.3f}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["examples/gated_deltanet.lr"])
