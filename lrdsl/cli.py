"""The `lrdsl` command line."""
from __future__ import annotations

import argparse
import json
import sys

from .errors import LrdslError, SpecError

EPILOG = """examples:
  lrdsl show examples/gated_deltanet.lr        desugared explicit form and canonical form
  lrdsl check examples/gdn2.lr                 eigenvalues, spectral norm, stability
  lrdsl check examples/gdn2.lr --json          the same as one JSON object
  lrdsl compile examples/gdn2.lr -o build/     write build/gdn2.py, a standalone torch + triton module
  lrdsl fuzz examples/gdn2.lr --examples 20    kernels vs the float64 reference on random cases
  lrdsl bench examples/gated_deltanet.lr --backward
                                               GPU: ms, TFLOP/s and memory beside FLA's twin
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lrdsl", description="Compile linear-recurrence token mixers "
                                "from a spec: parse, check the transition, emit kernels.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from . import __version__
    p.add_argument("--version", action="version", version=f"lrdsl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("show", help="print the explicit form and the canonical form of a spec")
    s.add_argument("spec", help="path to a .lr spec file")
    c = sub.add_parser("check", help="prove or disprove facts about the transition's eigenvalues")
    c.add_argument("spec", help="path to a .lr spec file")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    g = sub.add_parser("compile", help="write the generated kernels module (imports only torch and triton)")
    g.add_argument("spec", help="path to a .lr spec file")
    g.add_argument("-o", "--output", metavar="DIR", default=".",
                   help="directory to write <mixer name>.py into (created if missing; default: .)")
    f = sub.add_parser("fuzz", help="test the kernels against the float64 reference on random cases")
    f.add_argument("spec", help="path to a .lr spec file")
    f.add_argument("--examples", type=int, default=50, metavar="N", help="cases to draw (default: 50)")
    f.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the kernels run (default: cuda when available, else cpu through "
                        "Triton's interpreter)")
    f.add_argument("--seed", type=int, default=None, metavar="S", help="make the run reproducible")
    f.add_argument("--tol", type=float, default=None, metavar="R",
                   help="largest rms(kernel - reference) / rms(reference) for o and the final state "
                        "(default: 1e-4 on cpu, where the interpreter's dots are exact fp32; 5e-3 on "
                        "cuda, where the dots round their inputs to tf32)")
    f.add_argument("--grad", action=argparse.BooleanOptionalAction, default=True,
                   help="also compare the chunked kernels' gradients of every input and of the "
                        "initial state with float64 autograd through the reference (rms ratio < tol "
                        "for q, k, v, h0, < 10 tol for the other inputs; recurrent is forward-only "
                        "and not differentiated); default: on")
    b = sub.add_parser("bench", help="time the chunked kernels on the GPU beside flash-linear-attention's twin")
    b.add_argument("spec", nargs="+", help="path(s) to .lr spec files")
    b.add_argument("--shape", default="4,4096,16,128,128", metavar="B,T,H,K,V",
                   help="batch, tokens, heads, key and value size (default: 4,4096,16,128,128); bf16 inputs")
    b.add_argument("--backward", action="store_true", help="also time forward + backward and its peak memory")
    b.add_argument("--no-fla", dest="fla", action="store_false",
                   help="time lrdsl alone (by default FLA's twin is timed when fla-core is importable)")
    return p


def cmd_bench(args) -> int:
    from .errors import LrdslError
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        raise LrdslError(f"lrdsl bench needs torch and triton: {e}") from None
    from . import bench
    try:
        shape = bench.parse_shape(args.shape)
    except ValueError as e:
        raise LrdslError(str(e)) from None
    if not torch.cuda.is_available():
        raise LrdslError("lrdsl bench times GPU kernels, and torch sees no CUDA device")
    from .api import compile
    rows = []
    for i, path in enumerate(args.spec):
        print(f"[{i + 1}/{len(args.spec)}] {path}: compiling, tuning, timing", file=sys.stderr, flush=True)
        rows.append(bench.bench(compile(path), shape, args.backward, args.fla,
                                log=lambda s: print(s, file=sys.stderr, flush=True)))
    print(f"bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(bench.table(rows))
    return 0


def _load(path: str, check_stability: bool):
    from .api import compile
    return compile(path, check_stability=check_stability, load_kernels=False)


def cmd_show(args) -> int:
    m = _load(args.spec, check_stability=False)
    print("# explicit form")
    print(m.explicit(), end="")
    print("\n# canonical form")
    print(m.canonical(), end="")
    return 0


def cmd_check(args) -> int:
    from .checker import explain, stability_error
    m = _load(args.spec, check_stability=False)
    facts = m.check()
    msg = stability_error(m.ir, facts)
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
    else:
        from .printer import transition
        print(f"mixer {m.name}: M_t = {transition(m.ir)}")
        print(explain(facts), end="")
    if msg:
        raise SpecError(msg, m.ir.error_span(facts), m.source, m.filename)
    return 0


def cmd_compile(args) -> int:
    import os
    from pathlib import Path

    from .errors import LrdslError
    from .runtime import generate, write_atomic
    m = _load(args.spec, check_stability=True)
    source = generate(m.ir)
    path = Path(args.output) / f"{m.name}.py"
    _refuse_shadowing(m.name, path)
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise LrdslError(f"cannot write into {args.output}: it is not a directory")
    try:
        write_atomic(path, source)
    except OSError as e:
        raise LrdslError(f"cannot write {path}: {e.strerror or e}") from None
    print(path)
    return 0


def _refuse_shadowing(name: str, path) -> None:
    """<name>.py must not shadow a module importable here (a package such as mpmath, not only the
    standard library, which the front end refuses everywhere)."""
    import importlib.util
    from pathlib import Path

    from .errors import LrdslError
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if found is not None and (origin is None or Path(origin).resolve() != Path(path).resolve()):
        raise LrdslError(f"the mixer name '{name}' is the name of an importable module ({origin or 'a package'}), "
                         f"which {path} would shadow; rename the mixer")


class _ProgressBar:
    """`[#####.....] 12/50` on stderr, redrawn in place."""

    def __init__(self, width: int = 30):
        self.width, self.drawn = width, False

    def __call__(self, done: int, total: int, shrinking: bool) -> None:
        filled = self.width * done // max(total, 1)
        tail = "  failure found, shrinking it" if shrinking else ""
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total}{tail}")
        sys.stderr.flush()
        self.drawn = True

    def close(self) -> None:
        if self.drawn:
            sys.stderr.write("\n")


def cmd_fuzz(args) -> int:
    import os

    from .errors import LrdslError
    if args.examples < 1:
        raise LrdslError(f"--examples must be at least 1, got {args.examples}")
    if args.tol is not None and not args.tol > 0:
        raise LrdslError(f"--tol must be positive, got {args.tol}")
    device = args.device
    if device != "cpu":
        import torch
        if device == "cuda" and not torch.cuda.is_available():
            raise LrdslError("--device cuda: torch sees no CUDA device")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise LrdslError("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the kernels module does)
    tol = args.tol if args.tol is not None else (1e-4 if device == "cpu" else 5e-3)
    from .fuzz import run_fuzz
    m = _load(args.spec, check_stability=True)
    bar = _ProgressBar()
    try:
        result = run_fuzz(m, examples=args.examples, device=device, seed=args.seed, progress=bar,
                          tol=tol, grad=args.grad)
    finally:
        bar.close()
    if result.ok:
        print(result.summary())
        return 0
    print(result.summary(), file=sys.stderr)
    print(f"# shrunk failing case: {result.failure.case}; the snippet below reproduces it", file=sys.stderr)
    print(result.failure.snippet)
    return 1


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        return {"show": cmd_show, "check": cmd_check, "compile": cmd_compile,
                "fuzz": cmd_fuzz, "bench": cmd_bench}[args.command](args)
    except SpecError as e:
        print(str(e), file=sys.stderr)
        ctx = e.context()
        if ctx:
            print(ctx, file=sys.stderr)
        return 1
    except LrdslError as e:
        print(f"lrdsl: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
