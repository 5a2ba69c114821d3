"""The RWKV side beside FLA (issue 39): rwkv6, rwkv7, dplr, comba and iplr against their FLA twins
(lrdsl/bench.py TWINS), bf16 inputs, K = V = 128, at B=4 T=4096 H=16 and B=1 T=16384 H=32. For each:
GPU time (ms: the summed durations of a call's kernels under torch.profiler) of the forward and of
forward + backward, the peak memory each allocates above its inputs (GiB), and the rms ratio of
lrdsl's output to FLA's on the same inputs (a wrong mapping shows there). One table at the end (also
when stopped by SIGTERM or Ctrl-C: the rows finished). GPU only:
    python3 benchmarks/twins_rwkv.py [--shapes "4,4096,16,128,128 1,16384,32,128,128"] [SPEC ...]
On the device machine: BUDGET=540 benchmarks/device/twins_rwkv.sh (benchmarks/device/README.md).

FLA counts with the faster of two calls, per figure, and the memory of that call: its op with the
arguments made from lrdsl's inputs inside the timed call (`lrdsl bench`'s twin: the normalised
directions, beta*b, -kk and kk*a, comba's p exp(g): what a user of FLA pays), and (*)
its op alone on arguments made beforehand, every normalisation done outside. A last row per shape
(unless --no-bounded) times rwkv7 on decays in RWKV-7's own range, w = -0.6 sigmoid(x), with FLA
told that bound (lower_bound=-0.6, which licenses its 64-token chunks and tensor-core scheme, off by
default); lrdsl runs the same spec on the same tensors.

rwkv6's chunk reads S_prev and the bonus inside the staged kernels (plan.readout_before, one chunk
pass); a row per shape (unless --no-parts) times it the way it ran before 2026-12-06, the parts
around the kernels (Mixer._with_before: a shifted second chunk call and the bonus in PyTorch).
"""
from __future__ import annotations

import argparse
import signal
import sys

import torch

import lrdsl
from lrdsl.bench import TWINS, Shape, _fla, _fla_compiles_at_once, _l2norm, draw, measure, parse_shape, twin
from lrdsl.testing import rms_ratio

SPECS = ["examples/rwkv6.lr", "examples/rwkv7.lr", "examples/dplr.lr", "examples/comba.lr", "examples/iplr.lr"]
W_MIN = -0.6  # the bounded row's decays: w in (W_MIN, 0), RWKV-7's -exp(-0.5) sigmoid(.) rounded up
GIB = 2.0 ** 30
FIGURES = ("fwd_gpu_ms", "both_gpu_ms")
MEMORY = {"fwd_gpu_ms": "fwd_mem", "both_gpu_ms": "bwd_mem"}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fla_calls(mixer, x: dict, extra: dict) -> list:
    """[(label, f, tensors)]: FLA's op as bench's twin calls it, and its op alone on arguments made
    beforehand; `extra` joins the op's keyword arguments."""
    name, args = TWINS[mixer.name]
    op = _fla(name)
    _, run = twin(mixer)
    calls = [("in call", (lambda t: run(t)) if not extra else
              (lambda t: op(**args(dict(t)), **extra)[0]), x)]
    normalised = dict(x, **{i.name: _l2norm(x[i.name]) for i in mixer.ir.inputs if i.l2norm})
    with torch.no_grad():
        kw = dict(args(normalised), **extra)
    if "use_qk_l2norm_in_kernel" in kw:
        kw["use_qk_l2norm_in_kernel"] = False
    tensors = {k: v.detach().contiguous() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)}
    calls.append(("alone", lambda t: op(**t, **rest)[0], tensors))
    return calls


def parts_chunk(mixer):
    """mixer.chunk as its readout of the state before the update ran around the kernels (the
    parts: Mixer._with_before), for the row that compares it with the fused route."""
    def chunk(q, k, v, **inputs):
        batch = mixer._validate(q, k, v, inputs, None, None, False, None)
        return mixer._with_before("chunk", batch, None)
    return chunk


def row(mixer, s: Shape, label: str, bounded: bool, parts: bool = False) -> dict:
    x = draw(mixer, s)
    chunk = parts_chunk(mixer) if parts else mixer.chunk
    extra = {}
    if bounded:  # RWKV-7's range for the decay, and FLA told it
        gen = torch.Generator(device="cuda").manual_seed(1)
        x["w"] = W_MIN * torch.sigmoid(torch.randn(x["w"].shape, generator=gen, device="cuda"))
        extra = {"lower_bound": W_MIN}
    out = {"mixer": label, "shape": s, "twin": TWINS[mixer.name][0]}
    out["lrdsl"] = measure(lambda t: chunk(**t)[0], x, s, True)
    log(f"  {label}: lrdsl {out['lrdsl']}")
    try:
        _fla_compiles_at_once()
        calls = fla_calls(mixer, x, extra)
        with torch.no_grad():
            out["rms"] = rms_ratio(chunk(**x)[0], calls[0][1](x))
        best = {}
        for name, f, tensors in calls:
            r = measure(f, tensors, s, True)
            log(f"  {label}: FLA {name} {r}")
            for key in FIGURES:
                if key not in best or r[key] < best[key][key]:
                    best[key] = dict(r, alone=name == "alone")
        out["fla"] = best
    except Exception as e:  # one op's failure must not hide the other rows
        out["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        log(f"  {label}: FLA failed: {out['error']}")
    return out


HEAD = ("| mixer | B,T,H | fwd GPU ms lrdsl / FLA | FLA/lrdsl fwd | f+b GPU ms lrdsl / FLA | FLA/lrdsl f+b "
        "| fwd extra GiB lrdsl / FLA | f+b extra GiB lrdsl / FLA | rms lrdsl vs FLA | FLA op |")


def table_row(r: dict) -> str:
    s, ll, ff = r["shape"], r["lrdsl"], r.get("fla", {})

    def ms(key):
        mine = f"{ll[key]:.3f}"
        if key not in ff:
            return f"{mine} / -", "-"
        star = "*" if ff[key]["alone"] else ""
        return f"{mine} / {ff[key][key]:.3f}{star}", f"{ff[key][key] / ll[key]:.2f}{star}"

    def mem(key):
        theirs = f"{ff[key][MEMORY[key]] / GIB:.2f}" if key in ff else "-"
        return f"{ll[MEMORY[key]] / GIB:.2f} / {theirs}"
    (fwd, rf), (both, rb) = ms("fwd_gpu_ms"), ms("both_gpu_ms")
    rms = f"{r['rms']:.1e}" if "rms" in r else r.get("error", "-")
    return (f"| {r['mixer']} | {s.B},{s.T},{s.H} | {fwd} | {rf} | {both} | {rb} | {mem('fwd_gpu_ms')} | "
            f"{mem('both_gpu_ms')} | {rms} | {r['twin']} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("spec", nargs="*", default=SPECS)
    p.add_argument("--shapes", default="4,4096,16,128,128 1,16384,32,128,128", help="B,T,H,K,V ...")
    p.add_argument("--no-bounded", dest="bounded", action="store_false",
                   help="leave out rwkv7 on RWKV-7's decay range with FLA's lower_bound")
    p.add_argument("--no-parts", dest="parts", action="store_false",
                   help="leave out rwkv6 through the parts around the kernels (the path before the fused readout)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        log("benchmarks/twins_rwkv.py times GPU kernels, and torch sees no CUDA device")
        return 2
    import triton
    shapes = [parse_shape(t) for t in a.shapes.split()]
    jobs = []
    for s in shapes:
        jobs += [(s, path, "") for path in a.spec]
        jobs += [(s, path, "bounded") for path in a.spec if a.bounded and path.endswith("rwkv7.lr")]
        jobs += [(s, path, "parts") for path in a.spec if a.parts and path.endswith("rwkv6.lr")]
    rows = []

    def stop(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    try:
        for i, (s, path, variant) in enumerate(jobs):
            mixer = lrdsl.compile(path)
            label = mixer.name + {"bounded": f" (w > {W_MIN}, FLA lower_bound)", "parts": " (parts around the kernels)",
                                  "": " (fused readout)" if mixer._fused else ""}[variant]
            log(f"[{i + 1}/{len(jobs)}] {label} at {s}: compiling, tuning, timing")
            rows.append(row(mixer, s, label, variant == "bounded", variant == "parts"))
            log("  row: " + table_row(rows[-1]))
    except KeyboardInterrupt:
        log(f"stopped: the table holds {len(rows)} of {len(jobs)} rows")
    print(f"bf16, K=V=128, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "GPU time; * FLA's op alone on arguments made before the call")
    print(HEAD + "\n|" + "---|" * (HEAD.count("|") - 1))
    for r in rows:
        print(table_row(r))
    return 0 if len(rows) == len(jobs) else 130


if __name__ == "__main__":
    sys.exit(main())
