"""Registers, spills and shared memory of each generated kernel launch, as ptxas reports them for
sm_90a, on a machine without a GPU, and the pipeliner's shared-memory rings (see rings()). Runs
the spec's chunk call (and backward) on CPU tensors with every launch intercepted: each launch is
compiled (not run) for the config LRDSL_AUTOTUNE=0 picks.

usage: python benchmarks/kernel_registers.py SPEC [--backward] [--only NAME] [--dump DIR] [--shape B,T,H,K,V]
                                               [--dtype bf16|fp32] [--config I]
Run from a checkout's root (that checkout's lrdsl is imported). The inputs are bf16 as in `lrdsl
bench` (--dtype fp32: fp32 inputs, so fp32 intermediates); on the CPU lrdsl runs its kernels on fp32
copies of bf16 inputs (the interpreter's bf16 dots are wrong), which this script turns off: no kernel
runs here. --config I (with --only): that kernel's I-th config of its tuning space instead of its
first (the GPU's autotuner may pick any; an I past the space's end says how many there are), or
one written out as probe_config.py takes it, e.g. --config BV=64,w=8,s=2 (maxnreg=N too)."""
import argparse
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["LRDSL_AUTOTUNE"] = "0"
sys.path.insert(0, os.getcwd())
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

ap = argparse.ArgumentParser()
ap.add_argument("spec"); ap.add_argument("--backward", action="store_true")
ap.add_argument("--only"); ap.add_argument("--dump"); ap.add_argument("--shape", default="1,256,2,128,128")
ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
ap.add_argument("--config", default="0")
a = ap.parse_args()
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 128)
DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
      torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1", torch.int16: "i16"}
OPTS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
        "debug", "instrumentation_mode", "launch_pdl"}
seen = {}


def rings(ttgir: str) -> str:
    """The pipeliner's shared-memory rings (slots x tile), and "(!)" where their depths differ. On the
    H200 (2026-12-02, 2862982) a kernel whose q and k tiles fed both a wgmma and a register sum got two slots for
    three stages (the state tile three): each async copy overwrote the slot a pending wgmma still
    read, and the H200 gave wrong output that the interpreter cannot show. Unequal depths are not
    always wrong (two loops may pipeline differently), but are worth a look at the TTGIR (--dump)."""
    found = [(n, t) for n, t in re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x([0-9x]*[a-z]+\d*)", ttgir)
             if int(n) > 1]  # one slot: a buffer, not a ring
    if not found:
        return single_slot_wgmma(ttgir)
    count = {}
    for slots, tile in found:
        count[f"{slots}x{tile}"] = count.get(f"{slots}x{tile}", 0) + 1
    mixed = len({slots for slots, _ in found}) > 1
    return (" rings=" + ",".join(f"{r}*{n}" for r, n in sorted(count.items())) + (" (!)" if mixed else "")
            + single_slot_wgmma(ttgir))


def single_slot_wgmma(ttgir: str) -> str:
    """" (1-slot wgmma!)" where an asynchronous wgmma reads a one-slot buffer of async copies. Found
    on the H200 on 2026-12-02 (staged_dk, 1fe8fc3): S0 and dS also feeding a register sum got one slot each, and the next
    tile's copy into it was issued while the wgmma reading it was still pending."""
    derived = set(re.findall(r"(%[\w.]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<1x", ttgir))
    for dst, src in re.findall(r"(%[\w.]+) = ttg\.memdesc_(?:index|trans|subslice|reinterpret) (%[\w.]+)", ttgir):
        if src in derived:
            derived.add(dst)
    for a, b in re.findall(r"= ttng\.warp_group_dot (%[\w.]+), (%[\w.]+), [^\n]*isAsync = true", ttgir):
        if a in derived or b in derived:
            return " (1-slot wgmma!)"
    return ""


def fake_run(self, *args, grid, warmup, **kwargs):
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTS}
    opts.pop("debug", None); opts.pop("instrumentation_mode", None)
    vals = dict(zip(self.arg_names, args)); vals.update(kwargs)
    sig, const, attrs = {}, {}, {}
    for p in self.params:
        v = vals.get(p.name, p.default if hasattr(p, "default") else None)
        if p.is_constexpr or v is None:
            sig[p.name] = "constexpr"; const[p.name] = v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + DT[v.dtype]
            if not p.do_not_specialize_on_alignment:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2**31 else "i32"
            if not p.do_not_specialize and v % 16 == 0 and v != 0:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{self.__name__}: {p.name} = {v!r}")
    name = self.__name__
    key = (name, tuple(sorted(opts.items())), tuple(sorted((k, str(v)) for k, v in const.items())))
    if key in seen or (a.only and a.only != name):
        return None
    k = triton.compile(ASTSource(self, sig, const, attrs), target=TARGET, options=opts)
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx"); open(f, "w").write(k.asm["ptx"])
        r = subprocess.run([PTXAS, "-v", "--gpu-name=sm_90a", f, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    info = r.stderr
    regs = re.search(r"Used (\d+) registers", info)
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    frame = re.search(r"(\d+) bytes stack frame", info)
    seen[key] = True
    print(f"{name:30s} warps={opts.get('num_warps', 4)} stages={opts.get('num_stages', 3)} "
          f"maxnreg={opts.get('maxnreg')} regs={regs.group(1) if regs else '?'} "
          f"spill st/ld={st.group(1) + '/' + st.group(2) if st else '?'} frame={frame.group(1) if frame else '?'} "
          f"smem={k.metadata.shared}{rings(k.asm['ttgir'])}", flush=True)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            open(os.path.join(a.dump, f"{name}.{ext}"), "w").write(k.asm[ext])
    return None


JITFunction.run = fake_run
import lrdsl  # noqa: E402
import lrdsl.api  # noqa: E402
from lrdsl.bench import draw, parse_shape  # noqa: E402

lrdsl.api._bf16_on_cpu = lambda *tensors: False  # the launches as the GPU makes them: bf16 stays bf16
m = lrdsl.compile(a.spec)
if a.config != "0":
    # the spec's own module, or those it runs on (a split spec's, rwkv7's say, or a product's sub-mixer's)
    mods = [k.kernels for k in (m, m.split) if k is not None]
    tuners = [(mod, n, getattr(mod, n)) for mod in mods for n in getattr(mod, "TUNING_SPACE", {})]
    tuners = [(mod, n, t) for mod, n, t in tuners if a.only and t.fn.__name__ == a.only]
    if not tuners:
        sys.exit(f"--config needs --only naming an autotuned kernel of {a.spec}")
    for mod, n, t in tuners:
        space = mod.TUNING_SPACE[n]
        if a.config.isdigit():
            if int(a.config) >= len(space):
                sys.exit(f"{n}'s tuning space has {len(space)} configs: --config 0 .. {len(space) - 1}")
            t.configs = [space[int(a.config)]]
        else:
            from probe_config import parse_config
            t.configs = [parse_config(a.config)]
        t.cache.clear()
x = draw(m, parse_shape(a.shape), torch.bfloat16 if a.dtype == "bf16" else torch.float32, "cpu")
if a.backward:
    for t in x.values():
        if t.is_floating_point():
            t.requires_grad_()
o = m.chunk(**x)
o = o[0] if isinstance(o, tuple) else o
if a.backward:
    o.float().sum().backward()
