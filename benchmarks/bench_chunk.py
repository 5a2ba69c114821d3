"""Time lrdsl's chunked kernels beside flash-linear-attention's, on one GPU, in one run.

Usage (device machine): python benchmarks/bench_chunk.py [B T H D]. Prints one line per mixer as it
goes, the kernel breakdown of two mixers (torch.profiler), and a table last.
"""
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import lrdsl

B, T, H, D = (int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (4, 4096, 16, 128)))
dev, dt = "cuda", torch.bfloat16
ROOT = os.path.join(os.path.dirname(__file__), "..", "examples")
MIXERS = os.environ.get("MIXERS", "linear_attention,mamba2,gla,deltanet,gated_deltanet,kda,gdn2,"
                        "precond_deltanet").split(",")


def fla_ops():
    try:
        import fla.ops.common.chunk_o as _co
        _co.TRITON_ABOVE_3_7_1 = True  # timing only: FLA refuses its gated backward on triton 3.6 (#640)
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.gla import chunk_gla
        from fla.ops.kda import chunk_kda
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # fla-core not installed there: lrdsl alone
        print("fla unavailable:", type(e).__name__, e)
        return {}
    return {
        "mamba2": lambda x: chunk_simple_gla(x["q"], x["k"], x["v"], g=x["g"])[0],
        "gla": lambda x: chunk_gla(x["q"], x["k"], x["v"], g=x["g"])[0],
        "gated_deltanet": lambda x: chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                           use_qk_l2norm_in_kernel=True)[0],
        "kda": lambda x: chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=True)[0],
    }


def inputs(m):
    x = {}
    for i in m.ir.inputs:
        shape = (B, T, H) + (() if i.kind == "scalar" else (D,))
        t = torch.randn(shape, device=dev)
        if i.log:
            t = F.logsigmoid(t + 3)
        elif i.lo == 0:
            t = torch.sigmoid(t)
        x[i.name] = t.to(torch.float32 if i.log else dt).requires_grad_()
    return x


def timed(f, x):
    do = torch.randn(B, T, H, D, device=dev, dtype=dt)
    with torch.no_grad():
        fwd = do_bench(lambda: f(x), warmup=10, rep=50, return_mode="median")

    def step():
        f(x).backward(do)
    both = do_bench(step, warmup=5, rep=30, return_mode="median", grad_to_none=list(x.values()))
    return fwd, both


def profile(name, m, x):
    from torch.profiler import ProfilerActivity, profile as prof
    do = torch.randn(B, T, H, D, device=dev, dtype=dt)
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        m.chunk(**x)[0].backward(do)
        torch.cuda.synchronize()
    print(f"\nkernels of {name} (fwd + bwd, one call):")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40))


def main():
    torch.manual_seed(0)
    fla = fla_ops()
    rows = []
    for name in MIXERS:
        m = lrdsl.compile(os.path.join(ROOT, name + ".lr"))
        x = inputs(m)
        lf, lb = timed(lambda x: m.chunk(**x)[0], x)
        ff = fb = None
        if name in fla:
            try:
                ff, fb = timed(fla[name], x)
            except Exception as e:
                print(name, "fla failed:", type(e).__name__, str(e)[:120])
        rows.append((name, lf, lb, ff, fb))
        print(name, lf, lb, ff, fb, flush=True)
        if name in os.environ.get("PROFILE", "deltanet,kda").split(","):
            profile(name, m, x)
    fmt = lambda t: "     n/a" if t is None else f"{t:8.3f}"
    print(f"\nms, bf16, B={B} T={T} H={H} K=V={D}, {torch.cuda.get_device_name()}")
    print(f"{'mixer':20s} {'lrdsl fwd':>9s} {'fla fwd':>8s} {'lrdsl f+b':>9s} {'fla f+b':>8s}")
    for name, lf, lb, ff, fb in rows:
        print(f"{name:20s} {fmt(lf):>9s} {fmt(ff)} {fmt(lb):>9s} {fmt(fb)}")


if __name__ == "__main__":
    main()
