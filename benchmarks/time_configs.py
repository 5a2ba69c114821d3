"""GPU time of one forward + backward for each config of each staged kernel's tuning space.

Usage (device machine): python benchmarks/time_configs.py SPEC [--shape B,T,H,K,V] [--only staged_dq,staged_dk]
                        [--extra staged_dk:BV=64,w=8,s=3 ...]
One kernel's config at a time, every other kernel at the first config of its space (as the GPU
suite's test_every_staged_config runs them); then the whole spaces under the autotuner, with the
configs it picked, and the same without the causal second launches. --extra (repeatable) times a
config outside a kernel's space after that space's own (probe_config.py's format; check its values
with probe_config.py before it joins a space). bf16, shape B=4 T=4096 H=16 K=V=128 unless --shape says otherwise. A space's
losers can then leave it (each config costs cold-start time and a GPU suite case).
"""
import sys

import torch
from probe_config import parse_config
from triton.testing import do_bench

import lrdsl
from lrdsl.bench import Shape, draw, parse_shape


def label(cfg) -> str:
    cap = f" maxnreg={cfg.maxnreg}" if getattr(cfg, "maxnreg", None) else ""
    return f"{cfg.num_warps}w {cfg.num_stages}s " + " ".join(f"{k}={v}" for k, v in sorted(cfg.kwargs.items())) + cap


def main(argv):
    args, shape, only = list(argv), Shape(), None
    if "--shape" in args:
        i = args.index("--shape")
        shape = parse_shape(args[i + 1])
        del args[i:i + 2]
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        del args[i:i + 2]
    extra: dict = {}
    while "--extra" in args:
        i = args.index("--extra")
        name, _, cfg = args[i + 1].partition(":")
        extra.setdefault(name, []).append(parse_config(cfg))
        del args[i:i + 2]
    if len(args) < 1:  # the usage, not a traceback
        sys.exit(__doc__.strip())
    m = lrdsl.compile(args[0])
    x = {n: t.requires_grad_() if t.is_floating_point() else t for n, t in draw(m, shape).items()}
    leaves = [t for t in x.values() if t.requires_grad]
    do = torch.randn_like(m.chunk(**x)[0])

    def step():
        m.chunk(**x)[0].backward(do)

    space = m.kernels.TUNING_SPACE
    tuners = {n: getattr(m.kernels, n) for n in space if not n.endswith("_fp32")}
    saved = {n: t.configs for n, t in tuners.items()}

    def set_configs(choice):
        for n, t in tuners.items():
            t.configs = choice.get(n, space[n][:1])
            t.cache.clear()

    print(f"{m.name} B,T,H,K,V = {shape.B},{shape.T},{shape.H},{shape.K},{shape.V}: forward + backward ms")
    for n in tuners:
        if only is not None and n not in only:
            continue
        for cfg in list(space[n]) + extra.get(n, []):
            set_configs({n: [cfg]})
            step()
            ms = do_bench(step, warmup=10, rep=50, return_mode="median", grad_to_none=leaves)
            print(f"  {n:16s} {label(cfg):28s} {ms:.3f}")
    set_configs(saved)
    step()
    ms = do_bench(step, warmup=10, rep=50, return_mode="median", grad_to_none=leaves)
    print(f"  autotuned {ms:.3f}: " + "; ".join(f"{n} {label(t.best_config)}" for n, t in tuners.items()
                                                 if getattr(t, "best_config", None) is not None))
    # what the second (causal) launches cost when no chunk is flagged: their programs only read a
    # flag and leave (timing only: without them a non-finite input would spread over its chunk)
    passes, m.kernels.CAUSAL_PASSES = m.kernels.CAUSAL_PASSES, (False,)
    ms_plain = do_bench(step, warmup=10, rep=50, return_mode="median", grad_to_none=leaves)
    m.kernels.CAUSAL_PASSES = passes
    print(f"  autotuned without the causal launches {ms_plain:.3f} (they cost {ms - ms_plain:.3f})")


if __name__ == "__main__":
    main(sys.argv[1:])
