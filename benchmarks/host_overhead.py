"""Host (Python) time of mixer.chunk's forward and forward + backward, kernels left out (or, with
--cuda on a GPU, with them).

Every Triton launch (JITFunction.run, Autotuner.run, Heuristics.run) is replaced by a stub that
returns at once and counts the launch, so what is timed on small CPU tensors is lrdsl's own host
path: validation, the custom op's dispatch, allocations, the chain rule's host code. On the GPU
this time adds to the kernels' wherever the call is launch-bound (`lrdsl bench`'s wall ms above
its GPU ms). Outputs are uninitialised memory: only the time means anything here.

--cuda (a GPU, real launches, no stubs): per call, the host time until the call returns (the GPU
idle at its start: the launches are asynchronous, so this is the host's own time plus any wait
for the device) and the wall time to the device's end, do_bench's median, the GPU time (the
summed kernel durations, lrdsl.bench.gpu_ms) and wall / GPU (do_bench's over the GPU time: issue
43 asks for at most 1.05 for every example's forward + backward at the standard shape), and the
number of synchronising CUDA calls one forward + backward makes (torch.cuda.set_sync_debug_mode:
.item(), a host-to-device copy from a Python list, nonzero, ...), each a stall of the launch
pipeline. --nonfinite host|device picks runtime/nonfinite.py's MODE (default: the library's).

    python3 benchmarks/host_overhead.py [SPEC ...] [--reps N] [--dtype bf16|fp32|both]
                                        [--shape B,T,H,K,V] [--profile fwd|both] [--top N]
    python3 benchmarks/host_overhead.py --cuda --shape 4,4096,16,128,128 --reps 20 [--nonfinite host] [SPEC ...]
    python3 benchmarks/host_overhead.py --cuda --profile both --top 25 SPEC   (cProfile of real launches)
    python3 benchmarks/host_overhead.py --cuda --api --top 20 SPEC   (CUDA calls and torch operations)
    python3 benchmarks/host_overhead.py --cuda --profiler-first ...   (timed after a profiler session)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's lrdsl
if os.environ.get("TRITON_INTERPRET"):  # the launches are stubbed: no interpreter wanted
    os.environ.pop("TRITON_INTERPRET")

import torch  # noqa: E402

import lrdsl  # noqa: E402
from lrdsl.bench import parse_shape  # noqa: E402

LAUNCHES = [0]


def stub_launches():
    """Make every Triton launch a no-op that counts itself."""
    import triton.runtime.autotuner as autotuner
    import triton.runtime.jit as jit

    def run(self, *args, **kwargs):
        LAUNCHES[0] += 1

    jit.JITFunction.run = run
    autotuner.Autotuner.run = run
    autotuner.Heuristics.run = run


def inputs(mixer, s, dtype):
    """CPU inputs inside their declared ranges (values do not matter to the host path)."""
    x = {}
    for i in mixer.ir.inputs:
        shape = (s.B, s.T, s.H) + (() if i.kind == "scalar" else ((s.K,) if i.kind == "K" else (s.V,)))
        t = torch.rand(shape)
        if i.log:
            t = -t
        x[i.name] = t.to(dtype)
    from lrdsl.frontend.params import param_shape
    for p in mixer.ir.params:
        x[p.name] = torch.zeros(param_shape(p, s.H, s.K, s.V))
    return x


def timed(f, reps):
    """(fastest us per call, launches per call): the fastest of many is the least disturbed by
    other processes on a shared CPU."""
    f()
    LAUNCHES[0] = 0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e6, LAUNCHES[0] / reps


def steps(mixer, x):
    leaves = [t.requires_grad_() for t in x.values() if t.is_floating_point()]
    do = torch.randn_like(mixer.chunk(**x)[0].detach())

    def fwd():
        with torch.no_grad():
            mixer.chunk(**x)

    def both():
        mixer.chunk(**x)[0].backward(do)
        for t in leaves:
            t.grad = None
    return fwd, both


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("specs", nargs="*", default=["examples/linear_attention.lr", "examples/gated_deltanet.lr",
                                                 "examples/precond_deltanet.lr"])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", choices=["bf16", "fp32", "both"], default="both")
    ap.add_argument("--shape", default="1,256,2,64,64", help="B,T,H,K,V (default 1,256,2,64,64)")
    ap.add_argument("--profile", choices=["fwd", "both"], help="cProfile one spec's calls instead")
    ap.add_argument("--top", type=int, default=30, help="rows of each cProfile table")
    ap.add_argument("--cuda", action="store_true", help="on a GPU: real launches (see above)")
    ap.add_argument("--api", action="store_true",
                    help="with --cuda: the CUDA runtime and driver calls (launches, allocations, "
                         "synchronisations) and torch operations of the first spec's forward + backward, each "
                         "one's host time per call, under torch.profiler (what in the host time waits on the GPU)")
    ap.add_argument("--profiler-first", action="store_true",
                    help="with --cuda: one torch.profiler session (CUDA activity) before any timing, to see "
                         "whether a profiler that ran earlier in the process (as lrdsl bench's GPU times do) "
                         "slows the launches after it")
    ap.add_argument("--nonfinite", choices=["host", "device"], help="runtime/nonfinite.py's MODE")
    ap.add_argument("--ab-memo", action="store_true",
                    help="with --cuda: each spec with the autotuners' remembered choices (tuning.remember_choices, "
                         "the loader's default), without, and with again, in one process")
    a = ap.parse_args(argv)
    if a.nonfinite:
        from lrdsl.runtime import nonfinite
        nonfinite.MODE = a.nonfinite
    if a.cuda:
        return cuda_api(a) if a.api else cuda_profile(a) if a.profile else cuda_main(a)
    stub_launches()
    torch.set_num_threads(1)
    s = parse_shape(a.shape)
    dtypes = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}[a.dtype]
    if a.profile:
        mixer = lrdsl.compile(a.specs[0])
        fwd, both = steps(mixer, inputs(mixer, s, dtypes[0]))
        return profiled(fwd if a.profile == "fwd" else both, a.reps, a.top)
    print(f"{'spec':32s} {'dtype':8s} {'fwd us':>8s} {'launches':>8s} {'f+b us':>8s} {'launches':>8s}")
    for spec in a.specs:
        mixer = lrdsl.compile(spec)
        for dt in dtypes:
            fwd, both = steps(mixer, inputs(mixer, s, dt))
            f_us, f_n = timed(fwd, a.reps)
            b_us, b_n = timed(both, a.reps)
            print(f"{os.path.basename(spec):32s} {str(dt)[6:]:8s} {f_us:8.0f} {f_n:8.1f} {b_us:8.0f} {b_n:8.1f}")


def profiled(f, reps, top, sync=lambda: None):
    """cProfile's tables (cumulative, then own time) of reps calls of f after one unprofiled."""
    f()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        f()
        sync()
    prof.disable()
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
        print(out.getvalue())


def cuda_profile(a):
    """cProfile of the first spec's calls with real launches on the GPU, each call waited for
    (so a slow launch path shows as host time, not as time queued behind the device)."""
    from lrdsl.bench import draw
    mixer = lrdsl.compile(a.specs[0])
    fwd, both = steps(mixer, draw(mixer, parse_shape(a.shape)))
    for _ in range(3):
        both()
    profiled(fwd if a.profile == "fwd" else both, a.reps, a.top, torch.cuda.synchronize)


def cuda_api(a, reps=20):
    """The host side of the first spec's forward + backward under torch.profiler (CPU and CUDA
    activity): the step's wall us, then per step each CUDA runtime or driver call's count and host us
    (a synchronising one, or a cudaMalloc / cudaFree where the caching allocator missed, shows as a
    long call), then the torch operations' (nested ones counted inside their callers too)."""
    from torch.profiler import ProfilerActivity, profile

    from lrdsl.bench import draw
    mixer = lrdsl.compile(a.specs[0])
    fwd, both = steps(mixer, draw(mixer, parse_shape(a.shape)))
    for _ in range(5):
        both()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(reps):
            both()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / reps * 1e6
    rows = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
    api = sorted([e for e in rows if e.key.startswith(("cuda", "cu"))], key=lambda e: -e.cpu_time_total)
    ops = sorted([e for e in rows if e.key.startswith("aten::")], key=lambda e: -e.cpu_time_total)
    print(f"{a.specs[0]}, shape {a.shape}, forward + backward under the profiler: {wall:.0f} us per step")
    print(f"{'CUDA call':40s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s}")
    for e in api[:a.top]:
        print(f"{e.key[:40]:40s} {e.count / reps:10.1f} {e.cpu_time_total / reps:9.1f} {e.cpu_time_total / e.count:8.1f}")
    print(f"{'torch operation (nested ones too)':40s} {'calls/step':>10s} {'us/step':>9s} {'us/call':>8s}")
    for e in ops[:a.top]:
        print(f"{e.key[:40]:40s} {e.count / reps:10.1f} {e.cpu_time_total / reps:9.1f} {e.cpu_time_total / e.count:8.1f}")


def cuda_main(a):
    """Real launches on the GPU: per call the host ms (the GPU idle at the start) and the wall ms
    (to the device's end), do_bench's median as `lrdsl bench` takes it (the first row before any
    torch.profiler session of the process, unless --profiler-first; later rows after the GPU times
    of the rows before), and the synchronising calls of one forward + backward."""
    from lrdsl.bench import draw, gpu_ms
    from lrdsl.runtime import nonfinite, tuning
    s = parse_shape(a.shape)
    if a.profiler_first:
        gpu_ms(lambda: torch.ones(8, device="cuda").sum())
    print(f"{torch.cuda.get_device_name()}, shape {a.shape}, nonfinite.MODE {nonfinite.MODE}"
          + (", after a profiler session" if a.profiler_first else ""))
    print(f"{'spec':28s} {'fwd host':>8s} {'wall':>7s} {'do_bench':>8s} {'GPU':>7s} {'wall/GPU':>8s} "
          f"{'f+b host':>8s} {'wall':>7s} {'do_bench':>8s} {'GPU':>7s} {'wall/GPU':>8s} {'syncs':>5s}  (ms)")
    for spec in a.specs:
        mixer = lrdsl.compile(spec)
        fwd, both = steps(mixer, draw(mixer, s))
        if a.ab_memo:
            tuning.remember_choices(mixer.kernels)
        cuda_row(os.path.basename(spec), fwd, both, a.reps)
        if a.ab_memo and tuning.forget_choices(mixer.kernels):
            cuda_row(os.path.basename(spec) + " (no memo)", fwd, both, a.reps)
            tuning.remember_choices(mixer.kernels)
            cuda_row(os.path.basename(spec) + " (memo again)", fwd, both, a.reps)


def cuda_row(label, fwd, both, reps):
    """One row of cuda_main's table: fwd's then both's host, wall, do_bench and GPU ms and do_bench
    over GPU, then the synchronising calls of one forward + backward."""
    import warnings

    from triton.testing import do_bench

    from lrdsl.bench import gpu_ms
    walls = []
    for f in (fwd, both):  # every host and wall time before the row's profiler sessions (gpu_ms)
        for _ in range(3):
            f()
        host, wall = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        walls.append((sorted(host)[len(host) // 2] * 1e3, sorted(wall)[len(wall) // 2] * 1e3,
                      do_bench(f, warmup=25, rep=100, return_mode="median")))
    row = []
    for f, (host_ms, wall_ms, bench_ms) in zip((fwd, both), walls):
        device_ms = gpu_ms(f)
        row += [host_ms, wall_ms, bench_ms, device_ms, bench_ms / device_ms]
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            both()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    widths = (8, 7, 8, 7, 8)
    print(f"{label:28s} " + " ".join(f"{v:{widths[i % 5]}.3f}" for i, v in enumerate(row)) + f" {len(syncs):5d}")
    for w in syncs:
        print(f"    sync: {w.filename}:{w.lineno}: {str(w.message)[:100]}")


if __name__ == "__main__":
    main()
