"""Stage 4 of the staged backward with a decay per key channel (staged_pair_kernel, launched without
the autotuner): its GPU time for each block size, key slice, warp count and register cap, in one
forward + backward, beside the gradients' relative RMS difference from the module's own setting.

Usage (device machine): python benchmarks/pair_sweep.py [--shape B,T,H,K,V] [--subs 16,32]
                        [--keys 16,32,64] [--warps 2,4,8] [--regs 0,128] SPEC [SPEC ...]
A split spec (rwkv7, dplr) sets its split's module (the staged kernels run there). rwkv7's pair
kernel took 2.43 of 9.02 ms of its forward + backward on an H100 on 2026-12-07 (13e1e70, B=4 T=4096
H=16, blocks of 16, keys 32, 4 warps, cap 128), 1.87 with d205dfd's blocks of 32, keys 64, no cap
(docs/kernels/host.md). The table is printed last.
"""
import itertools
import sys

import torch
from script_args import ints, option

import lrdsl
from lrdsl.bench import draw, kernel_times, parse_shape
from lrdsl.testing import rms_ratio


def main(argv) -> None:
    args = list(argv)
    shape = parse_shape(option(args, "--shape", "4,4096,16,128,128"))
    subs, keys, warps, regs = (ints(option(args, n, d)) for n, d in (
        ("--subs", "16,32"), ("--keys", "16,32,64"), ("--warps", "2,4,8"), ("--regs", "0,128")))
    if not args:
        sys.exit(__doc__.strip())
    rows = []
    for spec in args:
        mixer = lrdsl.compile(spec)
        mod = (getattr(mixer, "split", None) or mixer).kernels
        if not hasattr(mod, "STAGED_PAIR_KEYS"):
            print(f"{spec}: no staged_pair_kernel (no decay per key channel)")
            continue
        x = draw(mixer, shape)
        leaves = [t.requires_grad_() for t in x.values() if t.is_floating_point()]
        do = torch.randn_like(mixer.chunk(**x)[0])

        def grads():
            for t in leaves:
                t.grad = None
            mixer.chunk(**x)[0].backward(do)
            return [t.grad.clone() for t in leaves]

        def step():
            mixer.chunk(**x)[0].backward(do)

        def clear():
            for t in leaves:
                t.grad = None
        saved = (mod.STAGED_PAIR_SUB, mod.STAGED_PAIR_KEYS, mod.STAGED_PAIR_WARPS, mod.STAGED_PAIR_REGS)
        want = grads()
        for b, k, w, r in itertools.product(subs, keys, warps, regs):
            mod.STAGED_PAIR_SUB, mod.STAGED_PAIR_KEYS, mod.STAGED_PAIR_WARPS, mod.STAGED_PAIR_REGS = b, k, w, r
            try:
                got = grads()
                err = max(rms_ratio(g, h) for g, h in zip(got, want))
                times = kernel_times(step, between=clear)
                pair = sum(ms for name, ms, _ in times if name.startswith("staged_pair"))
                total = sum(ms for _, ms, _ in times)
            except Exception as e:  # e.g. out of shared memory or registers: the row says so
                err, pair, total = type(e).__name__, float("nan"), float("nan")
            mark = " (module)" if (b, k, w, r) == saved else ""
            rows.append((mixer.name, b, f"{k}{mark}", w, r, pair, total, err))
            print(rows[-1], flush=True)
        mod.STAGED_PAIR_SUB, mod.STAGED_PAIR_KEYS, mod.STAGED_PAIR_WARPS, mod.STAGED_PAIR_REGS = saved
    print(f"bf16, B,T,H,K,V = {shape}, {torch.cuda.get_device_name()}, GPU time (ms) of one forward + backward")
    print("| mixer | block | keys | warps | regs | staged_pair ms | f+b ms | grad rms vs module |")
    print("|---|---|---|---|---|---|---|---|")
    for name, b, k, w, r, pair, total, err in rows:
        e = err if isinstance(err, str) else f"{err:.1e}"
        print(f"| {name} | {b} | {k} | {w} | {r} | {pair:.3f} | {total:.3f} | {e} |")


if __name__ == "__main__":
    main(sys.argv[1:])
