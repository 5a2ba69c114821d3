"""Segmented state passes on one GPU (issue 43, lrdsl/runtime/segments.py): gated_deltanet, kda and
gla with and without segments beside FLA's chunk ops, forward and forward + backward, by GPU time
(the summed kernel durations, lrdsl.bench.gpu_ms) and wall clock, with the peak memory above the
inputs. Every row of a shape reads the same bf16 tensors.

    python benchmarks/segments.py [--specs gated_deltanet,kda,gla] [--shapes long,gva,std4,std1]
                                  [--segments auto,1,8,16,32,64] [--fwd-only] [--all-segments]
                                  [--flashqla]

Shapes (B, T, H key heads, HV value heads, K, V): long = 1,65536,4,4; gva = 1,65536,2,8 (four value
heads per key head); std4 = 4,4096,16,16; std1 = 1,16384,32,32; K = V = 128. `auto` is the
schedule's choice (segments.count, printed beside it); at the standard shapes only auto and 1 run
unless --all-segments. With --flashqla, gated_deltanet also runs Qwen's FlashQLA (`flash_qla`, TileLang;
its chunk_gated_delta_rule takes FLA's arguments and splits the sequence itself, `auto_cp`) on
FLA's arguments, a row of its own labelled FlashQLA. FLA's op gets the same tensors; where it refuses value heads grouped
over key heads, q and k are repeated to HV heads before the timed call (marked `rep`). The table
(markdown) is printed last: one row per spec, shape and variant, with FLA's time over each.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"long": (1, 65536, 4, 4, 128, 128), "gva": (1, 65536, 2, 8, 128, 128),
          "std4": (4, 4096, 16, 16, 128, 128), "std1": (1, 16384, 32, 32, 128, 128)}
STANDARD = ("std4", "std1")


def inputs(mixer, shape):
    """bench.draw at HV heads, the inputs shared by a key head's value heads cut to H heads."""
    from lrdsl.bench import Shape, draw
    B, T, H, HV, K, V = shape
    x = draw(mixer, Shape(B, T, HV, K, V))
    shared = {"q", "k", *(i.name for i in mixer.ir.inputs if i.shared)}
    return {n: (t[:, :, :H].contiguous() if n in shared and H != HV else t) for n, t in x.items()}


def fla_call(mixer, x, shape):
    """(label, f(x), x for f) of FLA's twin, or None: grouped value heads as they are where FLA takes
    them, else q and k repeated to HV heads (outside the timed call)."""
    from lrdsl.bench import twin
    tw = twin(mixer)
    if tw is None:
        return None
    name, run = tw
    B, T, H, HV, K, V = shape
    if H == HV:
        return name, run, x
    try:
        run(x)
        return name, run, x
    except Exception:
        shared = {"q", "k", *(i.name for i in mixer.ir.inputs if i.shared)}
        xr = {n: (t.repeat_interleave(HV // H, 2) if n in shared else t) for n, t in x.items()}
        return name + " rep", run, xr


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--specs", default="gated_deltanet,kda,gla")
    ap.add_argument("--shapes", default="long,gva,std4,std1")
    ap.add_argument("--segments", default="auto,1,8,16,32,64")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--all-segments", action="store_true", help="every --segments at the standard shapes too")
    ap.add_argument("--flashqla", action="store_true", help="gated_deltanet beside FlashQLA too (needs flash_qla)")
    a = ap.parse_args(argv)
    # FLA's column is its Triton kernels: fla-core 0.6 hands chunk_gated_delta_rule to FlashQLA
    # wherever flash_qla imports (its backend registry, read at each call), which made the two columns
    # one op on 2026-12-06; FlashQLA has its own row
    os.environ["FLA_FLASH_QLA"] = "0"
    import lrdsl
    from lrdsl.bench import _fla_compiles_at_once, measure
    from lrdsl.runtime import segments as seg
    backward = not a.fwd_only
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs", flush=True)
    rows = []
    for spec in a.specs.split(","):
        mixer = lrdsl.compile(ROOT / "examples" / f"{spec}.lr")
        for sname in a.shapes.split(","):
            shape = SHAPES[sname]
            B, T, H, HV, K, V = shape
            x = inputs(mixer, shape)
            auto = seg.count(B, HV, -(-V // seg.NOMINAL_BV), T, sms)
            fla = None
            tw = fla_call(mixer, x, shape)
            if tw is not None:
                try:
                    _fla_compiles_at_once()
                    fla = (tw[0], measure(tw[1], tw[2], None, backward))
                    print(f"{spec} {sname} FLA {tw[0]}: {fla[1]}", flush=True)
                except Exception as e:  # one op's failure must not hide the others
                    print(f"{spec} {sname} FLA failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            if a.flashqla and spec == "gated_deltanet" and tw is not None:
                peer = flashqla(tw[2], backward)
                if peer is not None:
                    rows.append((spec, shape, "FlashQLA", peer, fla))
            for variant in a.segments.split(","):
                n = None if variant == "auto" else int(variant)
                if sname in STANDARD and variant not in ("auto", "1") and not a.all_segments:
                    continue
                label = f"auto={auto}" if n is None else str(n)
                try:
                    r = measure(lambda x, n=n: mixer.chunk(**x, segments=n)[0], x, None, backward)
                except Exception as e:
                    print(f"{spec} {sname} segments {label} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                print(f"{spec} {sname} segments {label}: {r}", flush=True)
                rows.append((spec, shape, label, r, fla))
            del x
            torch.cuda.empty_cache()
    print(table(rows))
    return 0


def flashqla(x, backward):
    """FlashQLA's chunk_gated_delta_rule measured on FLA's arguments for x (bench.TWINS), or None with
    the reason printed (not installed, or its first call failed)."""
    from lrdsl.bench import TWINS, measure
    try:
        from flash_qla import chunk_gated_delta_rule
        args = TWINS["gated_deltanet"][1]
        r = measure(lambda x: chunk_gated_delta_rule(**args(x))[0], x, None, backward)
    except Exception as e:  # the peer is optional: say why it has no row
        print(f"FlashQLA failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None
    print(f"FlashQLA: {r}", flush=True)
    return r


def table(rows) -> str:
    gib = 2.0 ** 30
    out = ["| spec | B,T,H,HV | segments | fwd ms GPU (wall) | FLA fwd ms GPU | FLA/lrdsl fwd | f+b ms GPU (wall) "
           "| FLA f+b ms GPU | FLA/lrdsl f+b | f+b GiB lrdsl / FLA | FLA op |", "|" + "---|" * 11]
    for spec, (B, T, H, HV, K, V), label, r, fla in rows:
        f = fla[1] if fla else {}

        def ms(d, k):
            return f"{d[k + '_gpu_ms']:.3f} ({d[k + '_ms']:.3f})" if k + "_gpu_ms" in d else "-"

        def ratio(k):
            k += "_gpu_ms"
            return f"{f[k] / r[k]:.2f}" if k in f and k in r else "-"
        mem = f"{r['bwd_mem'] / gib:.2f} / {f['bwd_mem'] / gib:.2f}" if "bwd_mem" in r and "bwd_mem" in f else "-"
        out.append(f"| {spec} | {B},{T},{H},{HV} | {label} | {ms(r, 'fwd')} | {ms(f, 'fwd')} | {ratio('fwd')} | "
                   f"{ms(r, 'both')} | {ms(f, 'both')} | {ratio('both')} | {mem} | {fla[0] if fla else '-'} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
