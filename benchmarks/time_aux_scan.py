"""GPU time, launches and peak memory of one forward + backward of specs with auxiliary states: the
PyTorch chain rule with the doubling scan, with the Triton scan (lrdsl/scan.py), and the generated
chain-rule kernel around the Triton reverse scan (autograd.aux_chain_rule); and how far the latter
two's gradients are from the first's (relative norm of the difference, per input).

Usage (device machine): python benchmarks/time_aux_scan.py SPEC_STEM [SPEC_STEM ...] [--shape B,T,H,K,V]
(B=4 T=4096 H=16 K=V=128 bf16 by default). On a CPU (TRITON_INTERPRET=1) it runs as a dry run.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's lrdsl, not an installed one
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import lrdsl  # noqa: E402
import lrdsl.runtime.autograd as ag  # noqa: E402
from lrdsl.bench import Shape, draw, parse_shape  # noqa: E402

cuda = torch.cuda.is_available()
sync = torch.cuda.synchronize if cuda else (lambda: None)
args = [a for a in sys.argv[1:] if not a.startswith("--shape")]
shape = next((parse_shape(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--shape=")), Shape())


def run(m, x):
    for t in x.values():
        t.grad = None
    o = m.chunk(**x)[0]
    o.backward(torch.ones_like(o))


for stem in args:
    m = lrdsl.compile(f"examples/{stem}.lr")
    x = draw(m, shape, dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu")
    for t in x.values():
        if t.is_floating_point():
            t.requires_grad_()
    grads = {}
    modes = {"doubling scan": (False, False), "triton scan": (True, False), "generated chain": (True, True)}
    for mode, (ag.TRITON_SCAN, ag.GENERATED_AUX_CHAIN) in modes.items():
        run(m, x)  # compile, tune, warm up
        sync()
        grads[mode] = {n: t.grad.float().clone() for n, t in x.items() if t.grad is not None}
        peak = 0.0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            run(m, x)
            sync()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as p:
            run(m, x)
            sync()
        ka = [e for e in p.key_averages() if e.self_device_time_total > 0]
        gpu = sum(e.self_device_time_total for e in ka) / 1e3
        t0, n = time.time(), 5
        for _ in range(n):
            run(m, x)
        sync()
        wall = (time.time() - t0) / n * 1e3
        print(f"{stem} {mode}: GPU {gpu:.2f} ms, wall {wall:.2f} ms, "
              f"{sum(e.count for e in ka)} launches, peak {peak:.2f} GiB above the inputs")
        if mode != "doubling scan" and cuda:
            print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=16))
    for mode in ("triton scan", "generated chain"):
        for n, g in grads[mode].items():
            ref = grads["doubling scan"][n]
            print(f"  {mode} d{n}: |{mode} - doubling| / |doubling| = {((g - ref).norm() / ref.norm()).item():.2e}")
