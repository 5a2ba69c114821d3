"""Forward time of lrdsl's chunked kernels beside flash-linear-attention's, one GPU, one run.

Usage (device machine): python benchmarks/bench_fwd.py [B T H D]; prints a table last.
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


def fla_ops():
    try:
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


def main():
    torch.manual_seed(0)
    fla = fla_ops()
    rows = []
    for name in ("linear_attention", "mamba2", "gla", "deltanet", "gated_deltanet", "kda", "gdn2",
                 "precond_deltanet"):
        m = lrdsl.compile(os.path.join(ROOT, name + ".lr"))
        x = {}
        for i in m.ir.inputs:
            heads = H
            shape = (B, T, heads) + (() if i.kind == "scalar" else (D,))
            t = torch.randn(shape, device=dev)
            if i.log:
                t = F.logsigmoid(t + 3)
            elif i.lo == 0:
                t = torch.sigmoid(t)
            x[i.name] = t.to(torch.float32 if i.log else dt)
        with torch.no_grad():
            t_l = do_bench(lambda: m.chunk(**x), warmup=20, rep=100, return_mode="median")
            t_f = do_bench(lambda: fla[name](x), warmup=20, rep=100, return_mode="median") if name in fla else None
        rows.append((name, t_l, t_f))
        print(name, t_l, t_f, flush=True)
    print(f"\nforward ms, bf16, B={B} T={T} H={H} K=V={D}, {torch.cuda.get_device_name()}")
    print(f"{'mixer':20s} {'lrdsl':>8s} {'fla':>8s}")
    for name, a, b in rows:
        print(f"{name:20s} {a:8.3f} {('%8.3f' % b) if b else '     n/a'}")


if __name__ == "__main__":
    main()
