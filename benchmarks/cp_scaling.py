"""Context-parallel scaling of one spec's chunk: N ranks against one device at the same total length.

Usage (one process per GPU; NCCL, bf16):
    torchrun --nproc_per_node=N benchmarks/cp_scaling.py SPEC [--T 65536,131072] [--H 16 --K 128 --V 128]
Without a GPU it runs on gloo in float32 with the kernels in Triton's interpreter (bf16 dot is broken
there): only for testing this script at a tiny shape. With N = 1 it times the plain chunk.

For each total length T (one sequence, B = 1, split into N equal slices), rank 0 first runs the whole
sequence alone (the one-device row, skipped where it does not fit in memory), then every rank runs
mixer.chunk(..., cp_group) on its slice. Reported: the median over --reps calls of the slowest
rank's time, for the forward (no_grad) and the forward + backward; tokens/s in all and per device;
the peak memory allocated on any one device during a forward + backward; and the relative RMS error
of the ranks' outputs against the one-device output (the same global tensors: rank r's slice is drawn
from seed r). Prints a markdown table on rank 0.
"""
import argparse
import os
import statistics
import sys
import time

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before lrdsl imports triton

import torch.distributed as dist  # noqa: E402

import lrdsl  # noqa: E402
from lrdsl.bench import Shape, draw  # noqa: E402


def args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("spec")
    p.add_argument("--T", default="65536,131072", help="total lengths, comma-separated")
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128)
    p.add_argument("--V", type=int, default=128)
    p.add_argument("--reps", type=int, default=5, help="timed calls per measurement (after one warm-up)")
    return p.parse_args()


def sync():
    if CUDA:
        torch.cuda.synchronize()


def timed(fn, reps, group):
    """Median over reps of the slowest rank's time of fn() in ms (one untimed warm-up call first)."""
    fn()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    t = torch.tensor(times, device="cuda" if CUDA else "cpu", dtype=torch.float64)
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return 1e3 * statistics.median(t.tolist())


def measure(mixer, x, reps, group=None):
    """(fwd ms, fwd+bwd ms, peak GiB, o) of chunk on x (a slice when group is given)."""
    with torch.no_grad():
        fwd = timed(lambda: mixer.chunk(**x, cp_group=group), reps, group)
    both, peak = _measure_training(mixer, x, reps, group)  # its leaves and do are freed on return
    with torch.no_grad():
        o = mixer.chunk(**x, cp_group=group)[0]
    return fwd, both, peak, o


def _measure_training(mixer, x, reps, group):
    """(fwd+bwd ms, peak GiB): the peak counts inputs, gradients, do and one call's working memory."""
    leaves = {n: t.detach().requires_grad_() for n, t in x.items()}
    do = torch.randn_like(x["v"])

    def train():
        mixer.chunk(**leaves, cp_group=group)[0].backward(do)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    both = timed(train, reps, group)
    return both, torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan")


def main():
    a = args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    group = None
    if world > 1:
        dist.init_process_group("nccl" if CUDA else "gloo")
        group = dist.group.WORLD
    rank = dist.get_rank() if group else 0
    dev = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if CUDA else "cpu"
    if CUDA:
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if CUDA else torch.float32
    mixer = lrdsl.compile(a.spec)
    # compile every rank's kernels at once (rank 0's are the one-device run's; a later rank's head
    # runs with V + K value columns) before rank 0 times the one-device run alone
    tiny = draw(mixer, Shape(B=1, T=64, H=a.H, K=a.K, V=a.V), dtype, dev, seed=rank)
    tiny = {n: t.requires_grad_() for n, t in tiny.items()}
    mixer.chunk(**tiny, cp_group=group)[0].sum().backward()
    rows = []
    for T in (int(t) for t in a.T.split(",")):
        if T % world:
            raise SystemExit(f"--T {T} is not a multiple of the {world} ranks")
        shape = Shape(B=1, T=T // world, H=a.H, K=a.K, V=a.V)

        def slice_of(r):  # the same params on every rank (drawn from torch's global generator)
            torch.manual_seed(1234)
            return draw(mixer, shape, dtype, dev, seed=r)
        one = None
        if rank == 0:  # one device, the whole sequence: the slices side by side
            try:
                parts = [slice_of(r) for r in range(world)]
                per_token = {"q", "k", "v", *mixer.inputs}
                x = {n: (torch.cat([p[n] for p in parts], 1) if n in per_token else t)
                     for n, t in parts[0].items()}
                del parts
                one = measure(mixer, x, a.reps)
                one = (*one[:3], one[3].cpu())  # off the device before the ranks' peaks
                del x
            except torch.cuda.OutOfMemoryError:
                one = None
            rows.append((T, 1, *one[:3], None) if one else (T, 1, None, None, None, None))
            if CUDA:
                torch.cuda.empty_cache()
        if group is None:
            continue
        dist.barrier(group)
        fwd, both, peak, o = measure(mixer, slice_of(rank), a.reps, group)
        peaks = [None] * world
        dist.all_gather_object(peaks, peak, group=group)
        pieces = [torch.empty_like(o) for _ in range(world)]
        dist.all_gather(pieces, o.contiguous(), group=group)
        err = None
        if one is not None:
            ref = one[3].float()
            err = ((torch.cat(pieces, 1).cpu().float() - ref).pow(2).mean().sqrt()
                   / ref.pow(2).mean().sqrt()).item()
        rows.append((T, world, fwd, both, max(peaks), err))
    if rank == 0:
        print(table(mixer.name, a, rows, dtype))
    if group is not None:
        # every rank done, then out without the process group's teardown: gloo's threads aborted a
        # rank at exit ("terminate called without an active exception") in CI twice, once after a
        # barrier had been added before destroy_process_group. Nothing is left to send or to print.
        dist.barrier(group)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def table(name, a, rows, dtype) -> str:
    def f(x, fmt):
        return "-" if x is None or x != x else format(x, fmt)
    base = {T: both for T, n, _, both, _, _ in rows if n == 1}
    out = [f"{name}: B=1 H={a.H} K={a.K} V={a.V} {str(dtype).replace('torch.', '')}, median of {a.reps} "
           f"(slowest rank); 1 = one device on the whole sequence ('-': did not fit)", "",
           "| T | devices | fwd ms | fwd Mtok/s | per device | fwd+bwd ms | fwd+bwd Mtok/s | per device "
           "| speed-up fwd+bwd | peak GiB per device | o error vs 1 |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for T, n, fwd, both, peak, err in rows:
        tok = [None if t is None else T / t / 1e3 for t in (fwd, both)]  # ms -> Mtok/s
        up = None if both is None or base.get(T) is None else base[T] / both
        out.append(f"| {T} | {n} | {f(fwd, '.2f')} | {f(tok[0], '.3g')} | {f(tok[0] and tok[0] / n, '.3g')} "
                   f"| {f(both, '.2f')} | {f(tok[1], '.3g')} | {f(tok[1] and tok[1] / n, '.3g')} | {f(up, '.2f')} "
                   f"| {f(peak, '.2f')} | {f(err, '.2e')} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
