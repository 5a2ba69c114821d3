"""Decode (step at T = 1, inside a CUDA graph) for each value tile and warp count of the recurrent
kernel, beside FLA's fused recurrent twin, at each batch size: which setting the plan should take
(issue 43 asks every B in {1, 8, 64, 256} at or below FLA's time per token; kda at B = 256 read
0.99x on an H100 on 2026-12-06 with BV = 32 and one warp).

Usage (device machine): python benchmarks/decode_sweep.py [--batches 1,8,64,256] [--bv 16,32,64]
                        [--warps 1,2,4] SPEC [SPEC ...]
The module's RECURRENT_BV and RECURRENT_WARPS are set for each row (RECURRENT_MIN_BV with them, so
the small batches' narrowing does not undo the row's tile, and RECURRENT_WIDE's batch out of reach);
a row "plan" per batch runs the module's own choice; the table is printed last: us per
token, and FLA/lrdsl (above 1: lrdsl faster).
"""
import sys

import torch
from script_args import ints, option
from triton.testing import do_bench

import lrdsl
from lrdsl.bench import DECODE_TWINS, Shape, _fla, draw, graphed


def time_step(mixer, x, B, H, K, V) -> float:
    state = mixer.zero_state(B, H, K, V, device="cuda")
    out = torch.empty(B, 1, H, V, dtype=x["v"].dtype, device="cuda")

    def step():
        mixer.step(**x, state=state, out=out)
    return do_bench(graphed(step), warmup=25, rep=200, return_mode="median") * 1e3


def time_twin(mixer, x, B, H, K, V) -> float | None:
    if mixer.name not in DECODE_TWINS:
        return None
    name, args = DECODE_TWINS[mixer.name]
    op, h = _fla(name), torch.zeros(B, H, K, V, dtype=torch.float32, device="cuda")

    def fla_step():
        op(**args(x), initial_state=h, output_final_state=True)
    return do_bench(graphed(fla_step), warmup=25, rep=200, return_mode="median") * 1e3


def main(argv) -> None:
    args = list(argv)
    batches = ints(option(args, "--batches", "1,8,64,256"))
    bvs = ints(option(args, "--bv", "16,32,64"))
    warps = ints(option(args, "--warps", "1,2,4"))
    if not args:
        sys.exit(__doc__.strip())
    H, K, V = 16, 128, 128
    rows = []
    with torch.no_grad():
        for spec in args:
            mixer = lrdsl.compile(spec)
            mod = mixer.kernels
            saved = (mod.RECURRENT_BV, mod.RECURRENT_WARPS, mod.RECURRENT_MIN_BV, mod.RECURRENT_WIDE)
            for B in batches:
                x = draw(mixer, Shape(B, 1, H, K, V), device="cuda", seed=B)
                twin = time_twin(mixer, x, B, H, K, V)
                for bv in bvs:
                    for w in warps:  # each row's tile and warps, whatever the batch (no wide rule)
                        mod.RECURRENT_BV, mod.RECURRENT_WARPS, mod.RECURRENT_MIN_BV = bv, w, bv
                        mod.RECURRENT_WIDE = (1 << 62, bv, w)
                        us = time_step(mixer, x, B, H, K, V)
                        rows.append((mixer.name, B, bv, w, us, twin))
                        print(rows[-1], flush=True)
                mod.RECURRENT_BV, mod.RECURRENT_WARPS, mod.RECURRENT_MIN_BV, mod.RECURRENT_WIDE = saved
                rows.append((mixer.name, B, "plan", "plan", time_step(mixer, x, B, H, K, V), twin))
                print(rows[-1], flush=True)
    print("| mixer | B | BV | warps | lrdsl us (graph) | FLA us (graph) | FLA/lrdsl |")
    print("|---|---|---|---|---|---|---|")
    for name, B, bv, w, us, twin in rows:
        ratio = f"{twin / us:.2f}" if twin else ""
        print(f"| {name} | {B} | {bv} | {w} | {us:.1f} | {'' if twin is None else f'{twin:.1f}'} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1:])
