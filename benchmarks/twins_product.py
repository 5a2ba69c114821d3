"""DeltaProduct beside FLA (issue 40): examples/delta_product2.lr and delta_product3.lr against FLA's
chunk_gated_delta_product (lrdsl/bench.py TWINS), bf16, K = V = 128, at B=4 T=4096 H=16 and
B=1 T=16384 H=32: GPU time (ms, summed kernel durations under torch.profiler) of the forward and of
forward + backward, peak extra memory (GiB) and the rms ratio of lrdsl's output to FLA's, in
benchmarks/twins_rwkv.py's table. lrdsl gets the spec's separate tensors (k, k2, v, v2, ...), as a
user gives them, FLA its own interleaved layout ([B, T n, H, K]). Three more figures per row say
where lrdsl's time goes: its sub-mixer alone on sub-token inputs made beforehand ("sub alone": the
kernels of the n sub-tokens per token, without the PyTorch glue around them), lrdsl's chunk on the
interleaved copies of q, k and v that it made before its kernels read the spec's tensors themselves
("with copies": 2026-12-06, runtime/product.py's _per_step turned off), and FLA's
chunk_gated_delta_rule on FLA's own interleaved inputs (FLA's chunk_ref, the same sub-token scheme
on FLA's one-step kernels).
GPU only:
    python3 benchmarks/twins_product.py [--shapes "4,4096,16,128,128 1,16384,32,128,128"] [SPEC ...]
On the device machine: BUDGET=540 benchmarks/device/twins_product.sh (benchmarks/device/README.md).
"""
from __future__ import annotations

import argparse
import signal
import sys

import torch
from twins_rwkv import HEAD, log, row, table_row

import lrdsl
from lrdsl.bench import TWINS, _fla, draw, measure, parse_shape
from lrdsl.codegen import product as cp
from lrdsl.runtime import product as rp
from lrdsl.runtime.product import sub_inputs

SPECS = ["examples/delta_product2.lr", "examples/delta_product3.lr"]


def sub_alone(mixer, x: dict, s) -> dict:
    """The sub-mixer's chunk on its inputs made beforehand: the kernels' share of lrdsl's time."""
    with torch.no_grad():
        sx = {n: t.detach().contiguous() for n, t in sub_inputs(mixer.product_plan, x, s.H, s.H).items()}
    sub = mixer.product
    return measure(lambda t: sub.chunk(t[cp.Q], t[cp.C], t[cp.Z], **{n: v for n, v in t.items()
                                                                     if n not in (cp.Q, cp.C, cp.Z)})[0], sx, s, True)


def with_copies(mixer, x: dict, s) -> dict:
    """lrdsl's chunk on the interleaved [B, n T, ...] copies of q, k and v (runtime/product.py's
    sub_inputs, the path before the sub-token kernels): what reading the spec's tensors saves."""
    keep = rp._per_step
    rp._per_step = lambda mixer, batch: None
    try:
        return measure(lambda t: mixer.chunk(**t)[0], x, s, True)
    finally:
        rp._per_step = keep


def fla_interleaved(mixer, x: dict, s) -> dict:
    """FLA's one-step chunk_gated_delta_rule on the interleaved inputs of its chunk_ref."""
    name, args = TWINS[mixer.name]
    n = mixer.ir.n_steps
    with torch.no_grad():
        kw = args(dict(x))
        q = torch.zeros(s.B, s.T, n, s.H, s.K, dtype=kw["q"].dtype, device="cuda")
        q[:, :, -1] = kw["q"]
        g = torch.zeros(s.B, s.T, n, s.H, dtype=torch.float32, device="cuda")
        g[:, :, 0] = kw["g"]
        t = dict(q=q.flatten(1, 2), k=kw["k"], v=kw["v"], g=g.flatten(1, 2), beta=kw["beta"])
    op = _fla("gated_delta_rule.chunk_gated_delta_rule")
    return measure(lambda a: op(**a, scale=kw["scale"], use_qk_l2norm_in_kernel=True)[0][:, n - 1::n], t, s, True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("spec", nargs="*", default=SPECS)
    p.add_argument("--shapes", default="4,4096,16,128,128 1,16384,32,128,128", help="B,T,H,K,V ...")
    a = p.parse_args()
    if not torch.cuda.is_available():
        log("benchmarks/twins_product.py times GPU kernels, and torch sees no CUDA device")
        return 2
    import triton
    jobs = [(parse_shape(t), path) for t in a.shapes.split() for path in a.spec]
    rows, extra = [], []

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    try:
        for i, (s, path) in enumerate(jobs):
            mixer = lrdsl.compile(path)
            log(f"[{i + 1}/{len(jobs)}] {mixer.name} at {s}: compiling, tuning, timing")
            rows.append(row(mixer, s, mixer.name, False))
            log("  row: " + table_row(rows[-1]))
            x = draw(mixer, s)
            figures = {"sub alone": sub_alone(mixer, x, s), "with copies": with_copies(mixer, x, s)}
            try:
                figures["FLA one-step interleaved"] = fla_interleaved(mixer, x, s)
            except Exception as e:  # FLA's failure must not hide lrdsl's figure
                log(f"  FLA interleaved failed: {type(e).__name__}: {str(e)[:200]}")
            extra.append((mixer.name, s, figures))
            log(f"  {figures}")
    except KeyboardInterrupt:
        log(f"stopped: the table holds {len(rows)} of {len(jobs)} rows")
    print(f"bf16, K=V=128, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "GPU time; * FLA's op alone on arguments made before the call")
    print(HEAD + "\n|" + "---|" * (HEAD.count("|") - 1))
    for r in rows:
        print(table_row(r))
    print("\n| mixer | B,T,H | what | fwd GPU ms | f+b GPU ms |\n|---|---|---|---|---|")
    for name, s, figures in extra:
        for what, r in figures.items():
            print(f"| {name} | {s.B},{s.T},{s.H} | {what} | {r['fwd_gpu_ms']:.3f} | {r['both_gpu_ms']:.3f} |")
    return 0 if len(rows) == len(jobs) else 130


if __name__ == "__main__":
    sys.exit(main())
