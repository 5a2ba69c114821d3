"""What the non-finite guards of the general and offline-solve kernels cost on clean inputs (#42).

Three rows per spec, at the benchmark shape in bf16 (forward and forward + backward, wall ms by
triton's do_bench, and GPU ms of the kernels alone):
  guarded  the kernels as generated: plain products over a chunk's tokens, the causal product only
           where a plain one is not finite (common.jinja's _guarded_dot), and the backward's guard
           on the device (runtime/nonfinite.py's MODE "device": finite copies of the inputs, flags
           read by the kernels, no wait for the device; since 2026-12-06);
  host     the same, the backward's guard read back instead (MODE "host": one reduction per input
           and one wait for the device per backward, copies only for a bad batch);
  no-check the same kernels, the backward's check skipped (MODE "host", nonfinite.bad_entries
           answers None);
  plain    the plan's causal_nonfinite off: no guard at all (plain products), no check.
Run it at this commit and at one before the guard (e.g. 4e7fc30, where every chunk took the causal
products; that commit has no runtime/nonfinite.py, and its no-check row is its guarded one) to
see what the guard saves. The general kernels serve every spec here (STAGED_MAX_K = 0, as
tests/test_recurrent.general_kernels does); the offline solve (mesa) has only its own. GPU only:
    python3 benchmarks/nonfinite_general.py [--shape B,T,H,K,V] [SPEC ...]
"""
import argparse
import dataclasses

import lrdsl
import lrdsl.codegen.generate as generate_module
import lrdsl.codegen.solve as solve_module
from lrdsl.bench import draw, measure, parse_shape


def _compiled(spec, causal):
    """The mixer with the plan's causal_nonfinite as given (the plan is looked up where the module's
    source is generated, and the cache key follows the source)."""
    saved = generate_module.plan, solve_module.plan
    try:
        for mod in (generate_module, solve_module):
            mod.plan = lambda m, base=saved[0]: dataclasses.replace(base(m), causal_nonfinite=causal)
        mixer = lrdsl.compile(spec, check_ranges=False)
    finally:
        generate_module.plan, solve_module.plan = saved
    if mixer.ir.solve_lam is None:
        mixer.kernels.STAGED_MAX_K = 0  # the general kernels
        if mixer.split is not None:
            mixer.split.kernels.STAGED_MAX_K = 0
    return mixer


def _timed(mixer, shape, check, mode="device"):
    try:
        from lrdsl.runtime import nonfinite
    except ImportError:  # before the backward's check
        nonfinite = None
    saved = (nonfinite.bad_entries, getattr(nonfinite, "MODE", None)) if nonfinite else None
    if nonfinite:
        nonfinite.MODE = mode if check else "host"  # (a MODE set before it existed does nothing)
    if nonfinite and not check:
        nonfinite.bad_entries = lambda *args: None
    try:
        return measure(lambda t: mixer.chunk(**t)[0], draw(mixer, shape), shape, True)
    finally:
        if nonfinite:
            nonfinite.bad_entries, nonfinite.MODE = saved


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="4,4096,16,128,128", help="B,T,H,K,V")
    ap.add_argument("specs", nargs="*", default=["examples/gated_deltanet.lr", "examples/kda.lr", "examples/mesa.lr"])
    args = ap.parse_args()
    shape = parse_shape(args.shape)
    print(f"shape {args.shape} (B,T,H,K,V), bf16")
    print(f"{'spec':28s} {'variant':9s} {'fwd ms':>8s} {'fwd gpu':>8s} {'f+b ms':>8s} {'f+b gpu':>8s}")
    for spec in args.specs:
        guarded, plain = _compiled(spec, True), _compiled(spec, False)
        for name, mixer, check, mode in (("guarded", guarded, True, "device"), ("host", guarded, True, "host"),
                                         ("no-check", guarded, False, "host"), ("plain", plain, False, "host")):
            r = _timed(mixer, shape, check, mode)
            print(f"{spec:28s} {name:9s} {r['fwd_ms']:8.3f} {r['fwd_gpu_ms']:8.3f} {r['both_ms']:8.3f} "
                  f"{r['both_gpu_ms']:8.3f}", flush=True)


if __name__ == "__main__":
    main()
