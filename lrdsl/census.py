"""The census of a chunked call: for each kernel it launches, the tensor-core FLOPs (every tl.dot,
2 M N K) and the bytes its loads and stores ask for (every masked-in element at its pointer's width),
counted by running the generated kernels in Triton's interpreter, on the CPU.

The counts are the kernels' own, not the algorithm's (roofline.py counts those): a tile loaded twice
counts twice, as the kernel asks for it twice (on the GPU the second may come from a cache), so the
bytes are the traffic the kernel requests, an upper bound of what reaches memory, and each address
a launch touches counts once in `unique_bytes`, the least it can move (a bound that caches across
launches alone can beat); elementwise arithmetic is not counted. Inputs are fp16, as wide as bf16 (on the CPU `chunk` runs bf16 on fp32 copies:
docs/kernels.md, Precision), so every tensor the GPU keeps in bf16 counts two bytes here too. The kernels take
the first config of each tuning space (LRDSL_AUTOTUNE=0's choice) unless --configs names theirs
(`lrdsl bench --per-kernel` passes the tiles its autotuners chose: tuning.chosen).

Each kernel's counts are a sum of parts per call (a flag every program reads), per head (a
parameter), per sequence and head (a state) and per token of each (an input), the last affine in
the number of chunks: the call is counted at one sequence and head for two lengths, and at two
sequences and at two heads, and the four parts taken at the asked shape: exact where the shape holds
whole chunks (tests/test_census.py), every kernel's programs walking or taking whole chunks.

    python -m lrdsl.census SPEC [--shape B,T,H,K,V] [--backward] [--json] [--configs JSON]
(sets TRITON_INTERPRET=1 and hides any GPU for itself; `lrdsl bench --per-kernel` runs it so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys

import torch


@dataclasses.dataclass(frozen=True)
class Counts:
    launches: float = 0.0
    flop: float = 0.0
    load_bytes: float = 0.0  # requested: every masked-in element of every load
    store_bytes: float = 0.0
    unique_bytes: float = 0.0  # each address a launch loads, and each it stores, once: the least it moves

    def __add__(self, o: "Counts") -> "Counts":
        return Counts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(o))))

    def scaled(self, f: float) -> "Counts":
        return Counts(*(a * f for a in dataclasses.astuple(self)))

    @property
    def bytes(self) -> float:
        return self.load_bytes + self.store_bytes


def _width(dtype) -> int:
    return max(1, dtype.primitive_bitwidth // 8)


@contextlib.contextmanager
def counting():
    """Within: every kernel launched through Triton's interpreter adds to the dict yielded (kernel
    name -> Counts)."""
    import triton.runtime.interpreter as interp

    from lrdsl.runtime import loader
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the census runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before lrdsl is imported (python -m lrdsl.census does)")
    import numpy as np
    found: dict = {}
    current = ["?"]
    touched: list = [{}]  # per launch: (load or store, element width) -> arrays of the addresses

    def add(**kw):
        found[current[0]] = found.get(current[0], Counts()) + Counts(**kw)

    def touch(ptrs, mask, width, kind):
        addresses = np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)].ravel()
        touched[-1].setdefault((kind, width), []).append(addresses)

    builder, grid_exec = interp.InterpreterBuilder, interp.GridExecutor
    saved = {n: getattr(builder, n) for n in ("create_dot", "create_masked_load", "create_masked_store",
                                              "create_atomic_rmw")}
    saved_call = grid_exec.__call__

    def dot(self, a, b, d, *rest):
        shape = a.data.shape
        add(flop=2.0 * float(torch.Size(shape[:-1]).numel()) * shape[-1] * b.data.shape[-1])
        return saved["create_dot"](self, a, b, d, *rest)

    def load(self, ptrs, mask, *rest):
        width = _width(ptrs.get_element_ty())
        add(load_bytes=float(mask.data.sum()) * width)
        touch(ptrs, mask, width, "load")
        return saved["create_masked_load"](self, ptrs, mask, *rest)

    def store(self, ptrs, value, mask, *rest):
        width = _width(ptrs.get_element_ty())
        add(store_bytes=float(mask.data.sum()) * width)
        touch(ptrs, mask, width, "store")
        return saved["create_masked_store"](self, ptrs, value, mask, *rest)

    def atomic(self, op, ptr, val, mask, *rest):
        width = _width(ptr.get_element_ty())
        n = float(mask.data.sum()) * width
        add(load_bytes=n, store_bytes=n)
        touch(ptr, mask, width, "load")
        touch(ptr, mask, width, "store")
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, *rest)

    def call(self, *args, **kwargs):
        outer, current[0] = current[0], getattr(self.fn, "__name__", "?")
        touched.append({})
        add(launches=1.0)
        try:
            return saved_call(self, *args, **kwargs)
        finally:
            mine = touched.pop()
            add(unique_bytes=float(sum(np.unique(np.concatenate(a)).size * w for (_, w), a in mine.items())))
            current[0] = outer

    for name, f in (("create_dot", dot), ("create_masked_load", load), ("create_masked_store", store),
                    ("create_atomic_rmw", atomic)):
        setattr(builder, name, f)
    grid_exec.__call__ = call
    try:
        # fp16 inputs (the interpreter's bf16, triton#11584) keep their intermediates in 2 bytes, as a
        # bf16 call's on the GPU: by default they would be fp32 (NARROW_DTYPES)
        with loader.narrow((torch.bfloat16, torch.float16)):
            yield found
    finally:
        for name, f in saved.items():
            setattr(builder, name, f)
        grid_exec.__call__ = saved_call


def counted(step) -> dict:
    """kernel name -> Counts of one step()."""
    with counting() as found:
        step()
    return found


def _steps(mixer, s, backward: bool):
    from lrdsl.bench import draw
    x = draw(mixer, s, dtype=torch.float16, device="cpu")

    def fwd():
        with torch.no_grad():
            mixer.chunk(**x)
    if not backward:
        return fwd
    leaves = [t.requires_grad_() for t in x.values() if t.is_floating_point()]
    do = torch.randn_like(mixer.chunk(**x)[0].detach())

    def both():
        mixer.chunk(**x)[0].backward(do)
        for t in leaves:
            t.grad = None
    return both


def lengths(mixer) -> tuple:
    """The two sequence lengths the census counts at: 2 and 4 chunks of the plan's staged forward."""
    from lrdsl.roofline import chunk_size
    bt = chunk_size(mixer)
    return 2 * bt, 4 * bt


def census(mixer, s, backward: bool = False) -> dict:
    """kernel name -> Counts of one call at shape s (forward, or forward + backward), from four
    counted calls at one sequence and head (two lengths), two sequences and two heads (see the
    module's docstring)."""
    from lrdsl.bench import Shape
    t1, t2 = lengths(mixer)
    points = ((1, 1, t1), (1, 1, t2), (2, 1, t1), (1, 2, t1))  # (sequences, heads, length)
    at = [counted(_steps(mixer, Shape(b, t, h, s.K, s.V), backward)) for b, h, t in points]
    out = {}
    for name in sorted(set().union(*at)):
        c11, c12, c21, c22 = (found.get(name, Counts()) for found in at)
        per_t = (c12 + c11.scaled(-1.0)).scaled(1.0 / (t2 - t1))  # per token of each sequence and head
        per_bh = c21 + c11.scaled(-1.0) + per_t.scaled(-t1)  # per sequence and head, beyond its tokens
        per_h = c22 + c21.scaled(-1.0)  # per head, whatever the sequences (parameters)
        fixed = c11 + per_t.scaled(-t1) + per_bh.scaled(-1.0) + per_h.scaled(-1.0)  # per call (flags)
        total = fixed + per_h.scaled(s.H) + per_bh.scaled(s.B * s.H) + per_t.scaled(s.B * s.H * s.T)
        out[name] = dataclasses.replace(total, launches=c12.launches)  # per call, whatever the shape
    return out


def numpy_problem() -> str | None:
    """Why Triton's interpreter cannot run the kernels here, or None: from numpy 2.4 on it fails on
    every loop over a tensor's count (triton#9171; lrdsl's CPU constraints pin numpy<2.4)."""
    import numpy
    if tuple(int(p) for p in numpy.__version__.split(".")[:2] if p.isdigit()) < (2, 4):
        return None
    return (f"Triton's interpreter cannot run lrdsl's kernels with numpy {numpy.__version__} (2.4 or later, "
            "triton#9171): install numpy<2.4 where the census runs")


def _interpreter_env() -> dict:
    """The environment of a census process: Triton's interpreter on, no GPU in sight."""
    return dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


def of(spec: str, s, backward: bool, configs: dict | None = None) -> dict:
    """{"fwd": counts[, "both": counts]} of a spec file at shape s, counted in a process of its own
    (this one may have its kernels on a GPU): `lrdsl bench --per-kernel`'s roofline per kernel.
    configs: kernel name -> the meta-parameters to count it with (tuning.chosen's: the tiles the
    GPU's autotuners chose), else each kernel's first config."""
    import subprocess
    shape = f"{s.B},{s.T},{s.H},{s.K},{s.V}"
    out = subprocess.run([sys.executable, "-m", "lrdsl.census", spec, "--shape", shape, "--json",
                          *(["--backward"] if backward else []), *(["--configs", json.dumps(configs)] if configs else [])],
                         env=_interpreter_env(), capture_output=True, text=True, check=True)
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    return {key: {n: Counts(**c) for n, c in calls.items()} for key, calls in raw.items()}


def modules(mixer) -> tuple:
    """The generated modules whose kernels mixer.chunk may launch, each once: a product's sub-token
    mixer's, a split spec's (two tokens per token), a value side's transposed key-side mixer's, the
    parts of a readout read around the kernels, and the mixer's own."""
    subs = [mixer.product, mixer.split, mixer.value_transposed if mixer.ir.side == "right" else None]
    if mixer.ir.reads_before and not mixer.ir.steps and not mixer._fused:
        subs += list(mixer._parts[:2])
    out = [mod for sub in subs if sub is not None for mod in modules(sub)]
    if not mixer.ir.steps:
        out.append(mixer.kernels)
    return tuple(dict.fromkeys(out))


def chosen(mixer) -> dict:
    """kernel name -> the meta-parameters the autotuners chose, over every module mixer.chunk may
    launch (`modules`; where two modules name one kernel, the first's: the staged route's)."""
    from lrdsl.runtime import tuning
    out: dict = {}
    for mod in reversed(modules(mixer)):
        out.update(tuning.chosen(mod))
    return out


def force(mixer, configs: dict) -> None:
    """Give each kernel that configs names (kernel name -> meta-parameters) that one config, in every
    module mixer.chunk may launch; ValueError naming the kernels there for a name none has."""
    from lrdsl.runtime import tuning
    mods = modules(mixer)
    names = sorted({tuning.kernel_name(t) for mod in mods for t in tuning._autotuners(mod)})
    unknown = sorted(set(configs) - set(names))
    if unknown:
        raise ValueError(f"--configs names {', '.join(unknown)}, which no autotuned kernel of "
                         f"'{mixer.name}' is called: its kernels are {', '.join(names)}")
    for mod in mods:
        tuning.force(mod, configs)


def for_bench(path: str, s, backward: bool, mixer) -> dict | None:
    """`of` for `lrdsl bench --per-kernel`, with the tiles this process's autotuners chose for the
    mixer, or None (said on stderr) where the count failed."""
    import subprocess

    problem = numpy_problem()
    if problem:
        print(f"  {path}: no census ({problem}); the per-kernel table has GPU times only", file=sys.stderr, flush=True)
        return None
    print(f"  {path}: counting each kernel's FLOPs and bytes (lrdsl.census, Triton's interpreter)",
          file=sys.stderr, flush=True)
    try:
        return of(path, s, backward, chosen(mixer))
    except (subprocess.CalledProcessError, ValueError) as e:
        tail = (getattr(e, "stderr", "") or str(e)).strip()
        print(f"  {path}: no census ({tail.splitlines()[-1] if tail else e}); the per-kernel table has GPU "
              "times only", file=sys.stderr, flush=True)
        return None


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m lrdsl.census", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="path to a .lr spec file")
    ap.add_argument("--shape", default="4,4096,16,128,128", metavar="B,T,H,K,V",
                    help="the shape to count at (default 4,4096,16,128,128)")
    ap.add_argument("--backward", action="store_true", help="count forward + backward (default: forward)")
    ap.add_argument("--json", action="store_true", help='print {"fwd": {kernel: {launches, flop, load_bytes, '
                    'store_bytes, unique_bytes}}} (and "both" with --backward)')
    ap.add_argument("--configs", metavar="JSON", help='the meta-parameters to count kernels with, as '
                    '{"staged_state_kernel": {"BV": 64}, ...} (default: each kernel\'s first config)')
    a = ap.parse_args(argv)
    problem = numpy_problem()
    if problem:
        print(f"python -m lrdsl.census: error: {problem}", file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") != "1":  # a process of its own, interpreter on, no GPU
        import subprocess
        return subprocess.call([sys.executable, "-m", "lrdsl.census", *(argv if argv is not None else sys.argv[1:])],
                               env=_interpreter_env())
    import lrdsl
    from lrdsl.bench import parse_shape
    from lrdsl.errors import LrdslError, SpecError
    try:
        mixer = lrdsl.compile(a.spec)
        s = parse_shape(a.shape)
        configs = json.loads(a.configs) if a.configs else {}
        if not isinstance(configs, dict) or not all(isinstance(c, dict) for c in configs.values()):
            raise ValueError('--configs takes a JSON object of objects, {"kernel name": {"BV": 64}, ...}')
    except SpecError as e:  # as `lrdsl` prints it: the file, place and fix, then the line and a caret
        print("\n".join(filter(None, (str(e), e.context()))), file=sys.stderr)
        return 2
    except (LrdslError, ValueError, OSError) as e:
        print(f"python -m lrdsl.census: error: {e}", file=sys.stderr)
        return 2
    try:
        force(mixer, configs)
    except ValueError as e:
        print(f"python -m lrdsl.census: error: {e}", file=sys.stderr)
        return 2
    if a.json:  # both calls where --backward: `of`'s answer
        calls = ("fwd", "both") if a.backward else ("fwd",)
        print(json.dumps({key: {n: dataclasses.asdict(c) for n, c in census(mixer, s, key == "both").items()}
                          for key in calls}))
        return 0
    found = census(mixer, s, a.backward)
    from lrdsl.roofline import count_table
    print(f"{os.path.basename(a.spec)} at {a.shape}, {'forward + backward' if a.backward else 'forward'}, "
          f"counted in Triton's interpreter (fp16 inputs, {'the configs given' if configs else 'first configs'}):")
    print(count_table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
