"""One forward + backward with one staged kernel pinned to one config, in this process only.

Usage (device machine, one process per config: a fault leaves the CUDA context dead):
  CUDA_LAUNCH_BLOCKING=1 python benchmarks/probe_config.py SPEC KERNEL BV=64,w=4,s=2 [--shape B,T,H,K,V] [--varlen] [--state]
The config need not be in the kernel's tuning space (so a candidate taken out of it can be probed
again); every other staged kernel runs its space's first config. Prints one line: the gradients'
relative RMS difference from a run with KERNEL at its space's first config, or the error. bf16,
shape B=4 T=4096 H=16 K=V=128 unless --shape says otherwise; --varlen packs the batch into one
sequence cut at uneven points; --state adds an initial state and a final-state gradient (the GPU
suite's path: other kernel variants).
"""
import sys

import torch
import triton

import lrdsl
from lrdsl.bench import Shape, draw, parse_shape


def parse_config(text: str) -> triton.Config:
    """A config written out: block sizes, w (warps, default 4), s (stages, default 1) and an optional
    maxnreg, e.g. BV=64,w=8,s=2 (benchmarks/kernel_registers.py --config takes it too)."""
    kw = dict(p.split("=") for p in text.split(","))
    warps, stages = int(kw.pop("w", 4)), int(kw.pop("s", 1))
    cap = int(kw.pop("maxnreg")) if "maxnreg" in kw else None
    return triton.Config({k: int(v) for k, v in kw.items()}, num_warps=warps, num_stages=stages, maxnreg=cap)


def main(argv):
    args, shape = list(argv), Shape()
    if "--shape" in args:
        i = args.index("--shape")
        shape = parse_shape(args[i + 1])
        del args[i:i + 2]
    varlen, with_state = "--varlen" in args, "--state" in args
    args = [a for a in args if a not in ("--varlen", "--state")]
    if len(args) < 3:  # the usage, not a traceback
        sys.exit(__doc__.strip())
    spec, kernel, cfg = args[0], args[1], parse_config(args[2])
    m = lrdsl.compile(spec)
    space = m.kernels.TUNING_SPACE
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: smoke test in Triton's interpreter
    x = draw(m, shape, device=dev, seed=3)
    kw = {}
    if varlen:
        n = shape.B * shape.T
        x = {k: t.reshape(1, n, *t.shape[2:]) if t.shape[:2] == (shape.B, shape.T) else t for k, t in x.items()}
        kw["cu_seqlens"] = torch.tensor([0, 37, n // 2, n - 64, n], device=dev, dtype=torch.int32)
    do = torch.randn(1 if varlen else shape.B, shape.T * (shape.B if varlen else 1), shape.H, shape.V,
                     device=dev, dtype=torch.bfloat16)
    n_seq = 4 if varlen else shape.B
    h0 = torch.randn(n_seq, shape.H, shape.K, shape.V, device=dev) if with_state else None
    dht = torch.randn(n_seq, shape.H, shape.K, shape.V, device=dev) if with_state else None

    def grads(pinned):
        for n in space:
            t = getattr(m.kernels, n)
            t.configs = [pinned] if n == kernel else space[n][:1]
            t.cache.clear()
        leaves = {k: t.detach().clone().requires_grad_(t.is_floating_point()) for k, t in x.items()}
        if with_state:
            leaves["initial_state"] = h0.clone().requires_grad_()
        o, state = m.chunk(**leaves, **kw, output_final_state=with_state)[:2]
        loss = (o.float() * do.float()).sum()
        if with_state:
            loss = loss + (getattr(state, "S", state) * dht).sum()
        loss.backward()
        if dev == "cuda":
            torch.cuda.synchronize()
        return {k: t.grad.float() for k, t in leaves.items() if t.grad is not None}

    try:
        ref = grads(space[kernel][0])
        got = grads(cfg)
    except Exception as e:  # the launch that faulted is the last one before the synchronize
        print(f"{m.name} {kernel} {args[2]}: FAULT {type(e).__name__}: {str(e).splitlines()[0]}")
        return 1
    errs = {k: ((got[k] - ref[k]).norm() / ref[k].norm().clamp_min(1e-30)).item() for k in ref}
    print(f"{m.name} {kernel} {args[2]}: OK, rms vs first config " + " ".join(f"{k}={e:.1e}" for k, e in errs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
