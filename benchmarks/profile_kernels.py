"""Per-kernel GPU time of one forward (and with --backward, forward + backward) of each spec.

Usage (device machine): python benchmarks/profile_kernels.py SPEC [SPEC ...] [--backward] [--shape B,T,H,K,V] [--fla]
       [--set NAME=INT ...]
(`lrdsl bench --per-kernel` prints lrdsl's kernels' GPU time and share of the call beside its table.)
Shape B=4 T=4096 H=16 K=V=128 unless --shape says otherwise, bf16. --set sets a module-level
constant of each spec's generated module before the first call (a host-side switch such as
FUSED_OUTPUT=0, to time two paths in one run). Prints torch.profiler's table per
spec; with --fla also the table of its FLA twin on the same inputs (q, k normalised outside the call
where FLA can take them so, as `lrdsl bench` times its faster variant).
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import lrdsl
from lrdsl.bench import Shape, _prenormalisable, _unit, draw, parse_shape, twin
from lrdsl.roofline import kernel_table


def table(title, f, x, backward):
    if backward:
        for t in x.values():
            if t.is_floating_point():
                t.requires_grad_()
    for _ in range(3):  # tune and warm up outside the profile
        o = f(x)
        if backward:
            o.backward(torch.ones_like(o))
    do = torch.ones_like(o)  # made outside the profile: a fill the call does not run
    for t in x.values():  # else .grad adds up: add kernels (q, k, v, g, beta) the call does not run
        t.grad = None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        o = f(x)
        if backward:
            o.backward(do)
        torch.cuda.synchronize()
    print(f"\n{title} ({'forward + backward' if backward else 'forward'}):")
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=36))
    kernels = [(e.key, e.self_device_time_total / 1000.0, e.count) for e in p.key_averages() if e.self_device_time_total > 0]
    print(kernel_table(kernels, sum(k[1] for k in kernels)))  # each kernel's share of the call


backward, with_fla = "--backward" in sys.argv, "--fla" in sys.argv
args = sys.argv[1:]
shape = Shape()
if "--shape" in args:
    i = args.index("--shape")
    shape = parse_shape(args[i + 1])
    del args[i:i + 2]
sets = []
while "--set" in args:
    i = args.index("--set")
    name, _, value = args[i + 1].partition("=")
    sets.append((name, int(value)))
    del args[i:i + 2]
specs = [a for a in args if not a.startswith("--")]
if not specs:  # the usage, not silence
    sys.exit(__doc__.strip())
for path in specs:
    m = lrdsl.compile(path)
    for name, value in sets:
        if not hasattr(m.kernels, name):
            sys.exit(f"--set {name}: {path}'s generated module has no such constant")
        setattr(m.kernels, name, value)
    x = draw(m, shape)
    table(m.name, lambda x: m.chunk(**x)[0], dict(x), backward)
    tw = twin(m) if with_fla else None
    if tw is not None:
        pre = _prenormalisable(m)
        xf = dict(x, q=_unit(x["q"]), k=_unit(x["k"])) if pre else dict(x)
        xf = {n: t.detach().clone() for n, t in xf.items()}
        table(f"FLA {tw[0]}", lambda x: tw[1](x, prenormalised=pre), xf, backward)
