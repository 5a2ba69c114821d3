"""The `lrdsl` command line."""
from __future__ import annotations

import argparse
import json
import signal
import sys

from lrdsl.errors import LrdslError, SpecError

EPILOG = """examples:
  lrdsl show examples/gated_deltanet.lr        explicit form, canonical form, which kernels chunk runs
  lrdsl check examples/gdn2.lr                 eigenvalues, spectral norm, stability
  lrdsl check examples/gdn2.lr --json          the same as one JSON object
  lrdsl compile examples/gdn2.lr -o build/     write build/gdn2.py, a standalone torch + triton module
  lrdsl fuzz examples/gdn2.lr --examples 20    kernels vs the float64 reference on random cases
  lrdsl bench examples/gated_deltanet.lr --backward
                                               GPU: ms, TFLOP/s and memory beside FLA's twin
  lrdsl bench examples/kda.lr --keep-intermediates
                                               and a row for forward + backward keeping the intermediates
  lrdsl mqar examples/gated_deltanet.lr examples/gdn2.lr --plot mqar.png
                                               train a 2-layer model per spec on associative recall
  lrdsl check examples/gdn2.lr --plot gdn2.png   draw the eigenvalues, decay horizon and growth witness
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lrdsl", description="Compile linear-recurrence token mixers "
                                "from a spec: parse, check the transition, emit kernels.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    from lrdsl._version import __version__
    p.add_argument("--version", action="version", version=f"lrdsl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    s = sub.add_parser("show", help="print the explicit form, the canonical form and the kernels of a spec",
                       description="Print what lrdsl made of a spec: its inputs, the transition written out "
                                   "(explicit form), the canonical form along the DGPS axes (decay, gain, "
                                   "preconditioner, solve), and which kernels chunk and recurrent run, with "
                                   "the reason where a spec takes the general kernels. Needs no GPU.")
    s.add_argument("spec", help="path to a .lr spec file")
    c = sub.add_parser("check", help="prove or disprove facts about the transition's eigenvalues",
                       description="Bound the eigenvalues of the spec's transition over the inputs' declared "
                                   "ranges (sympy) and say what follows: stable or not, whether eigenvalues "
                                   "can be negative (state tracking), whether the spectral norm stays <= 1 "
                                   "and the state bounded, each proved, disproved with a witness, or left "
                                   "open, with the reasoning. A transition that can grow without bound is an "
                                   "error (exit status 1) with its place in the spec.")
    c.add_argument("spec", help="path to a .lr spec file")
    c.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    c.add_argument("--plot", metavar="FILE", default=None,
                   help="also draw the eigenvalues per head, the decay horizon and any witness of unbounded "
                        "growth into FILE (.png, .svg, .pdf; needs matplotlib)")
    g = sub.add_parser("compile", help="write the generated kernels module, forward only (imports only torch "
                                       "and triton)",
                       description="Write <mixer name>.py: the spec's Triton kernels and their host functions "
                                   "chunk (chunked) and recurrent (token by token), readable and the same "
                                   "bytes for the same spec. It imports only torch and triton. Its chunk and "
                                   "recurrent are forward only: they refuse inputs that require grad under "
                                   "grad mode; train through lrdsl.compile(spec).chunk, which wires the "
                                   "backward kernels into autograd.")
    g.add_argument("spec", help="path to a .lr spec file")
    g.add_argument("-o", "--output", metavar="DIR", default=".",
                   help="directory to write <mixer name>.py into (created if missing; default: .)")
    f = sub.add_parser("fuzz", help="test the kernels against the float64 reference on random cases",
                       description="Draw random cases (shapes, packed sequences, initial states, inputs "
                                   "inside their declared ranges) with Hypothesis and compare the chunked "
                                   "and recurrent kernels with the float64 reference scan by relative RMS "
                                   "error; a failing case is shrunk and printed so it can be replayed.")
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
    b = sub.add_parser("bench", help="time the chunked kernels on the GPU beside flash-linear-attention's twin",
                       description="Time the chunked kernels on the GPU beside flash-linear-attention's twin, "
                                   "on the same inputs: wall-clock ms per call and, in brackets, GPU time (the "
                                   "summed durations of the call's kernels), TFLOP/s and peak memory. "
                                   "Each spec's row is printed as it finishes; stopped (Ctrl-C, or SIGTERM "
                                   "from timeout) it says where and exits with 130.")
    b.add_argument("spec", nargs="+", help="path(s) to .lr spec files")
    b.add_argument("--shape", default="4,4096,16,128,128", metavar="B,T,H,K,V",
                   help="batch, tokens, heads, key and value size (default: 4,4096,16,128,128); bf16 inputs")
    b.add_argument("--backward", action="store_true", help="also time forward + backward and its peak memory")
    b.add_argument("--keep-intermediates", action="store_true",
                   help="also time each spec compiled with keep_intermediates=True (the forward keeps what the "
                        "backward reads): a row of its own, lrdsl alone, forward + backward (implies --backward)")
    b.add_argument("--no-fla", dest="fla", action="store_false",
                   help="time lrdsl alone (by default FLA's twin is timed when fla-core is importable)")
    b.add_argument("--per-kernel", action="store_true",
                   help="also print each kernel's GPU time, share of the call and roofline (its FLOPs and bytes "
                        "counted by lrdsl.census in Triton's interpreter, some seconds per spec) under the table")
    b.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                   help="the GPU's dense bf16 peak for the roofline (default by name: H100 SXM 989, H200 989)")
    b.add_argument("--peak-tbps", type=float, metavar="TBPS",
                   help="the GPU's memory bandwidth in TB/s for the roofline (default by name: H100 SXM 3.35, H200 4.8)")
    b.add_argument("--decode", action="store_true",
                   help="time decoding instead: step at T = 1 for B in --decode-batches, inside a CUDA graph, "
                        "beside FLA's fused recurrent twin (H, K, V from --shape); the table is printed last")
    b.add_argument("--decode-batches", default="1,8,64,256", metavar="B,B,...",
                   help="the batch sizes of --decode (default 1,8,64,256)")
    _mqar_parser(sub)
    return p


def _ints(text: str) -> tuple:
    """A sorted set of positive integers from a comma list (argparse prints the error after the flag)."""
    from lrdsl.options import comma_ints
    try:
        return tuple(sorted(set(comma_ints(text))))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# a minute or two per spec on 2 CPU cores through Triton's interpreter: 30 training steps and
# 2 x 32 held-out sequences in batches of 4
MQAR_CPU_RECIPE = ("--seq-lens 16 --pairs 2,4 --vocab 32 --d-model 32 --layers 1",
                   "--heads 1 --head-dim 16 --batch 4 --steps 30 --eval-sequences 32")
MQAR_ABOUT = ("Multi-query associative recall (the Zoology setting): each sequence holds key-value pairs, then "
              "every key is queried once; the model must answer with its value. One model per spec (embedding, "
              "n x [lrdsl.nn.Layer, MLP], RMSNorm, head), trained for a fixed number of steps on every "
              "(sequence length, pairs) setting in turn, then evaluated on fresh sequences of each setting; "
              "every spec sees the same data. Prints the accuracy per spec and setting. The defaults are sized "
              "for a GPU (bf16 autocast); on a CPU (Triton's interpreter) take a tiny setting, a minute or two "
              "per spec:")


def _mqar_parser(sub) -> None:
    import textwrap
    from dataclasses import fields

    from lrdsl.options import Config
    d = Config()
    recipe = "  lrdsl mqar examples/gated_deltanet.lr {} \\\n      {}".format(*MQAR_CPU_RECIPE)
    m = sub.add_parser("mqar", help="multi-query associative recall: train a small model per spec, compare accuracy",
                       description=textwrap.fill(MQAR_ABOUT, 100) + "\n\n" + recipe,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("spec", nargs="+", help="path(s) to .lr spec files")
    # every field of Config is a flag, its default the field's (tests/test_mqar.py holds them equal)
    helps = {
        "steps": ("N", "training steps per spec"),
        "batch": ("N", "sequences per step (and per evaluation pass)"),
        "lr": ("LR", "peak learning rate of Adam, after a warm-up, before a cosine decay"),
        "seq_lens": ("T,T,...", "sequence lengths"),
        "pairs": ("P,P,...", "numbers of key-value pairs; a setting needs T >= 4 P"),
        "vocab": ("N", "vocabulary size: keys from the lower half, values from the upper"),
        "d_model": ("D", "model width"),
        "n_layers": ("N", "blocks of mixer and MLP"),
        "heads": ("H", "heads per mixer"),
        "head_dim": ("K", "K = V"),
        "eval_sequences": ("N", "held-out sequences per setting"),
        "seed": ("S", "seed of the data and of the initialisation, the same for every spec"),
    }
    for f in fields(Config):
        metavar, text = helps[f.name]
        default = getattr(d, f.name)
        if isinstance(default, tuple):  # shown and parsed as the comma list one types
            kind, default = _ints, ",".join(map(str, default))
        else:
            kind = type(default)
        flag = "--layers" if f.name == "n_layers" else "--" + f.name.replace("_", "-")
        m.add_argument(flag, dest=f.name, type=kind, default=default, metavar=metavar,
                       help=f"{text} (default: %(default)s)")
    m.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where to train (default: cuda when available, else cpu through Triton's interpreter)")
    m.add_argument("--plot", metavar="FILE", default=None,
                   help="save a plot of accuracy against pairs, one line per spec, one panel per T (needs matplotlib)")


def mqar_config(args):
    """The Config that `lrdsl mqar`'s parsed arguments ask for."""
    from dataclasses import fields

    from lrdsl.options import Config
    return Config(**{f.name: getattr(args, f.name) for f in fields(Config)})


def cmd_bench(args) -> int:
    from lrdsl.errors import LrdslError
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        raise LrdslError(f"lrdsl bench needs torch and triton: {e}") from None
    from lrdsl import bench, census
    try:
        shape = bench.parse_shape(args.shape)
    except ValueError as e:
        raise LrdslError(str(e)) from None
    if not torch.cuda.is_available():
        raise LrdslError("lrdsl bench times GPU kernels, and torch sees no CUDA device")
    from lrdsl.api import compile
    from lrdsl.roofline import peak_of
    for flag, value in (("--peak-tflops", args.peak_tflops), ("--peak-tbps", args.peak_tbps)):
        if value is not None and not value > 0:
            raise LrdslError(f"{flag} must be a positive number, got {value}")
    device = torch.cuda.get_device_name()
    peak = peak_of(device, args.peak_tflops, args.peak_tbps)
    print(f"bf16, {device}, torch {torch.__version__}, triton {triton.__version__}; roofline peaks: "
          + (f"{peak.tflops:g} TFLOP/s bf16, {peak.tbps:g} TB/s" if peak else
             "unknown for this GPU (give --peak-tflops and --peak-tbps for the percentages)"))
    if args.decode:
        return _bench_decode(args, shape, compile, bench)
    done = 0
    # a bench of many specs takes minutes: each spec's row is printed as it finishes, so a stop
    # by Ctrl-C or `timeout` (SIGTERM), or a kill, leaves the rows of the specs it finished
    print(bench.table_head(), flush=True)
    kernels = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, path in enumerate(args.spec):
            print(f"[{i + 1}/{len(args.spec)}] {path}: compiling, tuning, timing", file=sys.stderr, flush=True)
            backward = args.backward or args.keep_intermediates
            mixer = compile(path)
            row = bench.bench(mixer, shape, backward, args.fla,
                              log=lambda s: print(s, file=sys.stderr, flush=True),
                              **({"per_kernel": True} if args.per_kernel else {}))
            print(bench.table_row(row, peak), flush=True)
            if args.per_kernel:
                kernels.append(bench.kernel_tables(row, census.for_bench(path, shape, backward, mixer), peak))
            if args.keep_intermediates:
                row = bench.bench(compile(path, keep_intermediates=True), shape, True, False,
                                  log=lambda s: print(s, file=sys.stderr, flush=True))
                print(bench.table_row(dict(row, mixer=row["mixer"] + " (keep_intermediates)"), peak), flush=True)
            done += 1
    except KeyboardInterrupt:
        print(f"lrdsl bench: stopped during {args.spec[done]}; the table holds the "
              f"{done} of {len(args.spec)} specs it finished", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    for text in kernels:
        print("\n" + text, flush=True)
    return 0 if done == len(args.spec) else 130


def _bench_decode(args, shape, compile, bench) -> int:
    """lrdsl bench --decode: a row per spec and batch size as each finishes (on stderr), the table
    last on stdout."""
    from lrdsl.errors import LrdslError
    from lrdsl.options import comma_ints
    try:
        batches = comma_ints(args.decode_batches)
    except ValueError as e:
        raise LrdslError(f"--decode-batches: {e}") from None
    rows, done = [], 0
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for path in args.spec:
            mixer = compile(path)
            for B in batches:
                print(f"{path}: decode B={B}", file=sys.stderr, flush=True)
                rows.append(bench.decode_row(mixer, B, shape.H, shape.K, shape.V, args.fla))
                print("  " + bench.decode_table_row(rows[-1]), file=sys.stderr, flush=True)
            done += 1
    except KeyboardInterrupt:
        print(f"lrdsl bench --decode: stopped during {args.spec[done]}", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(bench.decode_table_head())
    for r in rows:
        print(bench.decode_table_row(r))
    return 0 if done == len(args.spec) else 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _load(path: str, check_stability: bool):
    from lrdsl.api import compile
    return compile(path, check_stability=check_stability, load_kernels=False)


def cmd_show(args) -> int:
    m = _load(args.spec, check_stability=False)
    print("# explicit form")
    print(m.explicit(), end="")
    print("\n# canonical form")
    print(m.canonical(), end="")
    print("\n# kernels")
    print(kernels_text(m.ir), end="")
    if m.ir.reads_before and m._fused:
        print("readout    S_prev^T y inside the staged kernels, one chunk pass (plan.readout_before,\n"
              "           lrdsl/codegen/readouts.py): P strictly causal, y decayed by G - g, the bonus on P's\n"
              "           diagonal; wider keys and recurrent take the parts around the kernels")
    elif m.ir.reads_before:
        print("readout    S_prev^T y and dot products around the kernels (lrdsl/codegen/readouts.py): the\n"
              "           kernels of S^T x and of S^T y with y read one token later, the dot products in PyTorch")
    return 0


def kernels_text(m) -> str:
    """Which kernels `chunk` runs for mixer IR m, and why (the `# kernels` section of `lrdsl show`)."""
    if m.steps:
        from lrdsl.codegen.product import direct, sub_ir
        from lrdsl.frontend import printer
        sub, d = sub_ir(m), direct(m)
        update = next(line for line in printer.explicit(sub).splitlines() if line.startswith("S = "))
        first, rest = kernels_text(sub).split("\n", 1)
        reads = (f"k and v the spec's {', '.join(d.keys)} and {', '.join(d.values)} as they come, beta "
                 f"{', '.join(map(str, d.gains))}" if d else "each step's vectors, computed in PyTorch (float32)")
        from lrdsl.codegen.plan import plan
        if d and plan(sub).sub_tokens:
            reads += (";\n           chunk's staged kernels read step j of token t from the spec's own tensors "
                      "(no\n           interleaved copy of q, k, v or o: plan.sub_tokens)")
        return (f"{first}\n           of the one-step sub-mixer, on {m.n_steps} sub-tokens per token (the {m.n_steps} "
                f"steps; lrdsl/codegen/product.py):\n           {update}, the log-decay g on the first "
                f"sub-token, o read at the last;\n           its inputs: {reads}\n" + rest)
    decode = "recurrent  token by token, one launch (templates/{}recurrent.py.jinja): the decode path\n"
    if m.solve_lam is not None:
        return "chunk      the offline solve's kernels (templates/mesa_chunk.py.jinja)\n" + decode.format("mesa_")
    if m.side == "both":
        return ("chunk      the two-sided token loop (templates/recurrent_value.py.jinja), all of K and V per\n"
                "           program; backward (templates/chunk_two_sided_bwd.py.jinja): a reverse token loop over\n"
                "           per_token's vectors from checkpoints every 32 tokens, their gradients carried to the\n"
                "           inputs by autograd through per_token (lrdsl/runtime/two_sided.py); no chunked form yet\n"
                "recurrent  token by token, one launch, all of V per program (templates/recurrent_value.py.jinja):\n"
                "           the decode path\n")
    if m.side == "right":
        from lrdsl.codegen import value_key
        why = value_key.eligible(m)
        if why is None:
            first = ("chunk      forward on the key side's staged kernels, run on S^T (lrdsl/codegen/value_key.py):\n"
                     "           stages 1 to 3 of the transposed mixer's staged forward, then the readout o = S^T q\n"
                     "           (templates/chunk_value_out.py.jinja); values wider than the staged kernels'\n"
                     "           keys, or LRDSL_VALUE_STAGED=0, take the token loop (templates/chunk_value.py.jinja);" + (
                         "\n           the transposed mixer is KDA on the raw inputs (value_key.direct): the kernels normalise,\n"
                         "           clamp and floor them, no per-token vectors in PyTorch, backward through its kernels;"
                         if value_key.direct(m) is not None else
                         "\n           its inputs the per-token vectors of T's transition, made in PyTorch;"))
        else:
            import textwrap
            first = textwrap.fill(f"the value side's token loop forward (templates/chunk_value.py.jinja), not the "
                                  f"key side's staged kernels: {why};", 98, initial_indent="chunk      ",
                                  subsequent_indent=" " * 11)
        back = ("\n           backward: the transposed mixer's chunk, forward + backward, read with do as its query\n"
                "           (lrdsl/runtime/value_key.py; the token loop's: chunk_value_bwd)\n" if why is None else
                "\n           backward (templates/chunk_value_bwd.py.jinja): a reverse token loop per key tile over\n"
                "           per_token's vectors from checkpoints every 64 tokens, their gradients carried to\n"
                "           the inputs by autograd through per_token (lrdsl/runtime/valueside.py)\n")
        return (f"{first}{back}"
                "recurrent  token by token, one launch, all of V per program (templates/recurrent_value.py.jinja):\n"
                "           the decode path\n")
    decode = decode.format("")
    from lrdsl.codegen.plan import plan, split_ir  # (plan.py imports split_ir)
    p = plan(m)
    wide = f"           keys wider than {p.staged_max_k} take the general kernels (templates/chunk.py.jinja)\n"
    if p.staged:
        per = {"diagonal": "a decay per key channel: 16-token blocks on tensor cores",
               "scalar": "a decay per token and head", "constant": "a decay per head",
               "identity": "no decay"}[m.decay.kind]
        return f"chunk      the staged kernels ({per})\n" + wide + decode
    s = split_ir(m)
    if s is None:
        return f"chunk      the general kernels (templates/chunk.py.jinja): {p.staged_reason}\n" + decode
    from lrdsl.frontend import printer
    native = ("           with LRDSL_NATIVE_RANK2=1, without gradients (finite inputs): the native staged\n"
              f"           forward on {p.staged_chunk}-token chunks (templates/staged_rank2.py.jinja; less memory,\n"
              "           slower so far)\n")
    update = next(line for line in printer.explicit(s).splitlines() if line.startswith("S = "))
    in_place = "           both read in place: no interleaved copy (runtime/split.py)\n" if plan(s).sub_tokens else ""
    return ("chunk      split (lrdsl/codegen/split.py): the staged kernels on two tokens per token (phase 0, 1) of\n"
            f"           {update}\n" + in_place + (native if p.rank2 else "") + wide + decode)


def cmd_check(args) -> int:
    from lrdsl.checks.checker import error_span, explain, stability_error
    if args.plot:
        from lrdsl import checkplot
        if not checkplot.available():
            raise LrdslError("--plot needs matplotlib, which is not installed: pip install matplotlib, "
                             "or leave out --plot")
    m = _load(args.spec, check_stability=False)
    facts = m.check()
    msg = stability_error(m.ir, facts)
    if args.json:
        print(json.dumps(facts, indent=2, sort_keys=True))
    else:
        from lrdsl.frontend.printer import product
        lhs = {"right": "N_t", "both": "M_t S N_t"}.get(m.ir.side, "M_t")
        print(f"mixer {m.name}: {lhs} = {product(m.ir)}")
        print(explain(facts), end="")
    if args.plot:  # drawn for a refused spec too: that picture says why
        checkplot.draw(m, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if msg:
        raise SpecError(msg, error_span(m.ir, facts), m.source, m.filename)
    return 0


def cmd_compile(args) -> int:
    import os
    from pathlib import Path

    from lrdsl.codegen.generate import generate
    from lrdsl.errors import LrdslError
    from lrdsl.runtime.loader import write_atomic
    m = _load(args.spec, check_stability=True)
    if m.ir.reads_before:
        from lrdsl.errors import SpecError
        raise SpecError("`lrdsl compile` writes a module of kernels that read S^T x; this readout's S_prev^T and "
                        "dot-product terms run in lrdsl.Mixer around them: use lrdsl.compile(spec) in Python",
                        m.ir.readout_span, m.source, m.filename)
    if m.ir.steps:
        from lrdsl.errors import SpecError
        raise SpecError(f"`lrdsl compile` writes a module of one-step kernels; this spec's {m.ir.n_steps} steps per "
                        "token run as sub-tokens of such kernels inside lrdsl.Mixer: use lrdsl.compile(spec) in Python",
                        m.ir.update_span, m.source, m.filename)
    source = generate(m.ir) + FORWARD_ONLY
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


# Appended to the module `lrdsl compile` writes. Its host functions run the forward kernels outside
# autograd (lrdsl.runtime.autograd wires the backward, and the written file must import only torch
# and triton), so their outputs carry no gradient: a call that asks for one is refused rather than
# training nothing in silence.
FORWARD_ONLY = '''

# ---- forward only: written by `lrdsl compile` ---------------------------------------------------
# chunk and recurrent run the forward kernels outside autograd: their outputs carry no gradient back
# to the inputs. So a call with an input that requires grad, under grad mode, is refused; train
# through lrdsl.compile(spec).chunk, which wires the backward kernels into autograd.
_forward_chunk, _forward_recurrent = chunk, recurrent


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _refuse_grad(name, args):
    if torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(args)):
        raise RuntimeError(f"{MIXER}.{name} is forward only (this standalone module wires no backward), "
                           "but an input requires grad: call it under torch.no_grad() or on detached "
                           "tensors, or train through lrdsl.compile(spec).chunk")


def chunk(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
          **inputs):
    """Chunk-parallel forward only: (o, final state or None). Refuses inputs that require grad."""
    _refuse_grad("chunk", (q, k, v, initial_state, inputs))
    return _forward_chunk(q, k, v, scale, initial_state, output_final_state, cu_seqlens, **inputs)


def recurrent(q, k, v, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              **inputs):
    """Token-by-token forward only: (o, final state or None). Refuses inputs that require grad."""
    _refuse_grad("recurrent", (q, k, v, initial_state, inputs))
    return _forward_recurrent(q, k, v, scale, initial_state, output_final_state, cu_seqlens, **inputs)
'''


def _refuse_shadowing(name: str, path) -> None:
    """<name>.py must not shadow a module importable here (a package such as mpmath, not only the
    standard library, which the front end refuses everywhere)."""
    import importlib.util
    from pathlib import Path

    from lrdsl.errors import LrdslError
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    origin = getattr(found, "origin", None)
    if found is not None and (origin is None or Path(origin).resolve() != Path(path).resolve()):
        raise LrdslError(f"the mixer name '{name}' is the name of an importable module ({origin or 'a package'}), "
                         f"which {path} would shadow; rename the mixer")


def _bar(label: str | None, total: int, unit: str):
    """tqdm's progress bar on stderr; it stays on screen when done."""
    from tqdm import tqdm
    return tqdm(desc=label, total=total, unit=unit, file=sys.stderr, dynamic_ncols=True)


def cmd_fuzz(args) -> int:
    from lrdsl.errors import LrdslError
    if args.examples < 1:
        raise LrdslError(f"--examples must be at least 1, got {args.examples}")
    if args.tol is not None and not args.tol > 0:
        raise LrdslError(f"--tol must be positive, got {args.tol}")
    device = _device(args.device)
    tol = args.tol if args.tol is not None else (1e-4 if device == "cpu" else 5e-3)
    from lrdsl.fuzz import run_fuzz
    m = _load(args.spec, check_stability=True)
    with _bar(None, args.examples, "case") as bar:
        def progress(done, total, shrinking):
            if shrinking:
                bar.set_postfix_str("failure found, shrinking it", refresh=False)
            bar.update(done - bar.n)
        result = run_fuzz(m, examples=args.examples, device=device, seed=args.seed, progress=progress,
                          tol=tol, grad=args.grad)
    if result.ok:
        print(result.summary())
        return 0
    print(result.summary(), file=sys.stderr)
    print(f"# shrunk failing case: {result.failure.case}; the snippet below reproduces it", file=sys.stderr)
    print(result.failure.snippet)
    return 1


def _device(asked: str | None) -> str:
    """cuda when asked for (and present) or when available; else cpu, through Triton's interpreter,
    which must be switched on before triton is first imported."""
    import os

    from lrdsl.errors import LrdslError
    device = asked
    if device != "cpu":
        import torch
        if device == "cuda" and not torch.cuda.is_available():
            raise LrdslError("--device cuda: torch sees no CUDA device")
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise LrdslError("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"
    return device


def cmd_mqar(args) -> int:
    from lrdsl.errors import LrdslError
    cfg = mqar_config(args)
    cfg.validate()
    from lrdsl import mqar
    if args.plot and not mqar.plot_available():
        raise LrdslError("--plot needs matplotlib, which is not installed: pip install matplotlib, or leave "
                         "out --plot to print the table only")
    device = _device(args.device)
    from lrdsl.api import compile
    from lrdsl.nn import Layer
    mixers = {}
    for path in args.spec:  # every spec compiled and fitted into a layer before any training
        m = compile(path)
        Layer(m, 8, 1, 8)
        mixers[m.name if m.name not in mixers else path] = m
    results = {}
    for i, (name, m) in enumerate(mixers.items()):
        print(f"[{i + 1}/{len(mixers)}] {name}: {cfg.steps} steps on {device}, then {cfg.eval_batches()} "
              "evaluation batches", file=sys.stderr, flush=True)
        with _bar(name, cfg.steps + cfg.eval_batches(), "step") as bar:
            def progress(done, total, loss, bar=bar):
                bar.set_postfix_str("evaluating" if loss is None else f"loss {loss:.3f}", refresh=False)
                bar.update(done - bar.n)
            results[name] = mqar.train(m, cfg, device, progress)
    print(mqar.table(results, cfg))
    if args.plot:
        mqar.plot(results, cfg, args.plot)
        print(f"plot: {args.plot}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command is None:
        _parser().print_help()
        return 2
    try:
        return {"show": cmd_show, "check": cmd_check, "compile": cmd_compile,
                "fuzz": cmd_fuzz, "bench": cmd_bench, "mqar": cmd_mqar}[args.command](args)
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
