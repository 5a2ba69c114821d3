"""GPU time, launches and peak memory of one forward + backward of specs with auxiliary states, with
the chain rule's auxiliary scans in Triton (lrdsl/scan.py) and with the PyTorch doubling scan, and
how far apart their gradients are.

Usage (device machine): python benchmarks/time_aux_scan.py SPEC_STEM [SPEC_STEM ...]   (B=4 T=4096 H=16 K=V=128 bf16)
"""
import sys, time, torch, lrdsl, lrdsl.autograd as ag
from lrdsl.bench import Shape, draw
from torch.profiler import ProfilerActivity, profile
s = Shape()
def run(m, x):
    o = m.chunk(**x)[0]
    o.backward(torch.ones_like(o))
for stem in sys.argv[1:]:
    m = lrdsl.compile(f"examples/{stem}.lr")
    x = draw(m, s)
    for t in x.values():
        if t.is_floating_point(): t.requires_grad_()
    grads = {}
    for mode in (False, None):
        ag.TRITON_SCAN = mode
        for t in x.values(): t.grad = None
        run(m, x); torch.cuda.synchronize()
        grads[mode] = {n: t.grad.float().clone() for n, t in x.items() if t.grad is not None}
        for t in x.values(): t.grad = None
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        run(m, x); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        for t in x.values(): t.grad = None
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            run(m, x); torch.cuda.synchronize()
        ka = p.key_averages()
        gpu = sum(e.self_device_time_total for e in ka) / 1e3
        ev = [e for e in ka if e.self_device_time_total > 0]
        t0 = time.time(); n = 5
        for _ in range(n):
            for t in x.values(): t.grad = None
            run(m, x)
        torch.cuda.synchronize(); wall = (time.time() - t0) / n * 1e3
        print(f"{stem} triton_scan={mode}: gpu {gpu:.2f} ms, wall {wall:.2f} ms, kernel names {len(ev)} launches {sum(e.count for e in ev)}, peak {peak:.2f} GiB")
        if mode is None:
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=14))
    for n in grads[None]:
        a, b = grads[None][n], grads[False][n]
        print(f"  d{n}: rel diff triton vs doubling {((a-b).norm()/b.norm()).item():.2e}")
