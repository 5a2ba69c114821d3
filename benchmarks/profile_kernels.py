"""Per-kernel GPU time of one forward (and with --backward, forward + backward) of each spec.

Usage (device machine): python benchmarks/profile_kernels.py SPEC [SPEC ...] [--backward] [--shape B,T,H,K,V]
Shape B=4 T=4096 H=16 K=V=128 unless --shape says otherwise, bf16. Prints torch.profiler's table per spec.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lrdsl
from lrdsl.bench import Shape, draw, parse_shape

backward = "--backward" in sys.argv
args = sys.argv[1:]
shape = Shape()
if "--shape" in args:
    i = args.index("--shape")
    shape = parse_shape(args[i + 1])
    del args[i:i + 2]
for path in [a for a in args if not a.startswith("--")]:
    m = lrdsl.compile(path)
    x = draw(m, shape)
    if backward:
        for t in x.values():
            t.requires_grad_()
    for _ in range(3):  # tune and warm up outside the profile
        o = m.chunk(**x)[0]
        if backward:
            o.backward(torch.ones_like(o))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        o = m.chunk(**x)[0]
        if backward:
            o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
    print(f"\n{m.name} ({'forward + backward' if backward else 'forward'}):")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=36))
