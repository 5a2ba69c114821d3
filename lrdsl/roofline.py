"""The roofline of `lrdsl bench`: nominal FLOPs and bytes of a chunked call, counted from the plan,
and what a measured time makes of them beside the GPU's bf16 peak and memory bandwidth.

The counts are the algorithm's, not the kernels': FLOPs per token and head of the chunked form
(bench.nominal_flop's terms), bytes a lower bound of the traffic (each input read once, the output
written once, each chunk's state written once and read once; the backward reads the inputs and the
output's gradient, writes the inputs' gradients, and writes and reads the states and their
gradients once more). The backward's FLOPs are twice the forward's, the usual count. So the
percentages say how far a call is from either roof, not which kernel to blame.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# Dense bf16 tensor-core TFLOP/s and memory TB/s from the vendor's data sheets, matched by the
# first name that the device's name contains (so "H100 PCIe" before "H100")
PEAKS = (
    ("H100 PCIe", 756.0, 2.0),
    ("H100 NVL", 835.0, 3.9),
    ("H100", 989.0, 3.35),
    ("H200", 989.0, 4.8),
)


@dataclass(frozen=True)
class Peak:
    name: str
    tflops: float  # dense bf16
    tbps: float  # memory bandwidth, TB/s


def peak_of(device_name: str, tflops: float | None = None, tbps: float | None = None) -> Peak | None:
    """The peaks of the named device (overridden by tflops, tbps where given), or None where the
    table has no entry and no override gives both."""
    for key, f, b in PEAKS:
        if key.lower() in device_name.lower():
            return Peak(key, f if tflops is None else tflops, b if tbps is None else tbps)
    if tflops is not None and tbps is not None:
        return Peak(device_name, tflops, tbps)
    return None


def chunk_size(mixer) -> int:
    """BT of the plan's staged forward (the chunk the counts take)."""
    from lrdsl.codegen.plan import plan
    m = mixer.product.ir if mixer.ir.steps else mixer.ir  # a product runs its sub-mixer's kernels
    return plan(m).staged_chunk


def flop(mixer, s, backward: bool = False, bt: int | None = None) -> float:
    """Nominal FLOPs of a forward (per token and head: state read and update 4KV, the causal pairwise
    block BT(K + V); with an erase also the corrected values 2KV and the solve BT(2K + V)), per
    sub-token of a product; three times that with the backward."""
    bt = chunk_size(mixer) if bt is None else bt
    per = 4 * s.K * s.V + bt * (s.K + s.V)
    if mixer.ir.delta is not None:
        per += 2 * s.K * s.V + bt * (2 * s.K + s.V)
    # a product (DeltaProduct): n sub-tokens per token
    return float(s.B * s.T * s.H * per * mixer.ir.n_steps) * (3 if backward else 1)


def _input_bytes(mixer, s, elt: int) -> int:
    """The inputs as `lrdsl bench` draws them: elt bytes an element, log-decays and params fp32."""
    tokens = s.B * s.T * s.H
    total = 0
    for i in mixer.ir.inputs:
        width = 1 if i.kind == "scalar" else (s.K if i.kind == "K" else s.V)
        total += tokens * width * (4 if i.log else elt)
    for p in mixer.ir.params:
        total += s.H * (1 if p.kind == "scalar" else (s.K if p.kind == "K" else s.V)) * 4
    return total


def nbytes(mixer, s, backward: bool = False, bt: int | None = None, elt: int = 2) -> float:
    """Nominal bytes moved (a lower bound): inputs read, output written, chunk states written and read
    (elt bytes each, as the staged kernels keep them in the inputs' dtype); with the backward also
    the inputs read again, the output's gradient read, the inputs' gradients written, and the chunk
    states and their gradients written and read."""
    bt = chunk_size(mixer) if bt is None else bt
    inputs = _input_bytes(mixer, s, elt)
    out = s.B * s.T * s.H * s.V * elt
    states = s.B * s.H * math.ceil(s.T * mixer.ir.n_steps / bt) * s.K * s.V * elt  # chunks of sub-tokens
    fwd = inputs + out + 2 * states
    if not backward:
        return float(fwd)
    return float(fwd + inputs + out + inputs + 4 * states)


def rates(flops: float, nbytes_: float, ms: float, peak: Peak | None) -> dict:
    """TFLOP/s and GB/s at ms, and their percentages of the peaks (None without a peak)."""
    tflops = flops / (ms * 1e-3) / 1e12
    gbps = nbytes_ / (ms * 1e-3) / 1e9
    return {"tflops": tflops, "gbps": gbps,
            "pct_flops": None if peak is None else 100 * tflops / peak.tflops,
            "pct_bw": None if peak is None else 100 * gbps / (peak.tbps * 1e3)}


def cells(r: dict) -> list:
    """The roofline columns of one measured call: TFLOP/s, GB/s, % of bf16 peak, % of bandwidth."""
    pct = (lambda x: "-" if x is None else f"{x:.1f}%")  # noqa: E731
    return [f"{r['tflops']:.1f}", f"{r['gbps']:.0f}", pct(r["pct_flops"]), pct(r["pct_bw"])]


def kernel_table(kernels: list, total_ms: float, counts: dict | None = None, peak: Peak | None = None) -> str:
    """Per-kernel rows (name, GPU ms per call, launches per call) as markdown, with each one's share of
    the call's GPU time, longest first; with counts (census.census': kernel name -> Counts) also each
    kernel's TFLOP/s, GB/s of the least bytes it moves (each address once) and their shares of the
    peaks, and the GB/s its loads and stores ask for (cache hits included); and the call's."""
    head = "| kernel | launches | GPU ms | share |"
    none = " - | - | - | - | - |"
    if counts is not None:
        head += " TFLOP/s | GB/s | % bf16 peak | % bandwidth | GB/s asked |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def roof(c, ms):
        if ms <= 0:
            return none
        return " " + " | ".join(cells(rates(c.flop, c.unique_bytes, ms, peak))) + f" | {c.bytes / (ms * 1e6):.0f} |"
    for name, ms, n in sorted(kernels, key=lambda k: -k[1]):
        share = 100 * ms / total_ms if total_ms > 0 else 0.0
        row = f"| {name} | {n:g} | {ms:.3f} | {share:.1f}% |"
        if counts is not None:
            row += roof(counts[name], ms) if name in counts else none
        lines.append(row)
    row = f"| (all) | {sum(k[2] for k in kernels):g} | {total_ms:.3f} | 100.0% |"
    if counts is not None:
        from functools import reduce
        timed = [counts[k[0]] for k in kernels if k[0] in counts]
        row += roof(reduce(lambda a, b: a + b, timed), total_ms) if timed else none
    lines.append(row)
    return "\n".join(lines)


def count_table(counts: dict) -> str:
    """census.census' counts as markdown: per kernel launches, GFLOP, MB its loads and stores ask for,
    the least MB it moves (each address once) and FLOPs per byte of those; then the call's."""
    lines = ["| kernel | launches | GFLOP | MB loaded | MB stored | MB at least | FLOP/byte |",
             "|---|---|---|---|---|---|---|"]

    def row(name, c):
        per = f"{c.flop / c.unique_bytes:.1f}" if c.unique_bytes else "-"
        return (f"| {name} | {c.launches:g} | {c.flop / 1e9:.2f} | {c.load_bytes / 1e6:.1f} | "
                f"{c.store_bytes / 1e6:.1f} | {c.unique_bytes / 1e6:.1f} | {per} |")
    for name, c in sorted(counts.items(), key=lambda kv: -kv[1].bytes):
        lines.append(row(name, c))
    if counts:
        from functools import reduce
        lines.append(row("(all)", reduce(lambda a, b: a + b, counts.values())))
    return "\n".join(lines)
