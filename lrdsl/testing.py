"""Helpers to test a mixer against its float64 reference, for lrdsl's tests and `lrdsl fuzz`
(as torch.testing serves PyTorch's): a Case (sizes, packed sequences, initial state, scale, seed),
inputs drawn inside the ranges the spec declares, the rms ratio, the forward and gradient checks,
and the runnable snippet of a failing case. The fuzzing driver and its tolerances are described in
lrdsl/fuzz.py."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from lrdsl.frontend import ir
from lrdsl.runtime.offline import cg_tolerance, kappa_bound
from lrdsl.runtime.tensors import MixerState

TOL = 1e-4
GATE_GRAD_FACTOR = 10  # gradients of inputs other than q, k, v and the initial state: 10 x tol
_QKVH = ("q", "k", "v", "initial_state")
IMPLS = ("recurrent", "chunk")
_INSET = 1e-3  # open interval ends: draw from [lo + 1e-3 w, hi - 1e-3 w]


# ---- cases and inputs ------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One draw: sizes, packing and options of a call, and the seed its tensors are drawn with."""
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    cu_seqlens: tuple | None = None  # (0, ..., T) with B == 1
    initial_state: bool = False
    scale: float | None = None
    seed: int = 0

    @property
    def N(self) -> int:
        return self.B if self.cu_seqlens is None else len(self.cu_seqlens) - 1

    def __post_init__(self):
        if self.HV % self.H:
            raise ValueError(f"HV={self.HV} is not a multiple of H={self.H}")
        if self.cu_seqlens is not None:
            c = self.cu_seqlens
            if self.B != 1 or c[0] != 0 or c[-1] != self.T or list(c) != sorted(c):
                raise ValueError(f"bad cu_seqlens {c} for B={self.B}, T={self.T}")


def _num(x) -> str:
    """A float literal that round-trips (repr), for generated snippet text."""
    return repr(float(x))


def input_line(inp) -> str:
    """Python text (over torch, F and the sizes B, T, H, HV, K, V) that draws one input in its range."""
    heads = "H" if inp.shared else "HV"
    shape = f"B, T, {heads}" if inp.kind == "scalar" else f"B, T, {heads}, {inp.kind}"
    if isinstance(inp, ir.Param):  # one value per head (and key or value channel), the same at every token
        shape = "HV" if inp.kind == "scalar" else f"HV, {inp.kind}"
    lo = float(inp.lo) if inp.lo.is_finite else -math.inf
    hi = float(inp.hi) if inp.hi.is_finite else math.inf
    if inp.l2norm:  # normalised inside the mixer: any vector
        return f"torch.randn({shape})"
    if inp.unit:  # declared unit norm: the caller's duty, so draw unit vectors
        return f"F.normalize(torch.randn({shape}), dim=-1)"
    if inp.log:  # log-decay <= 0 (an upper end below 0 shifts it)
        return f"F.logsigmoid(torch.randn({shape}))" + ("" if hi >= 0 else f" + {_num(hi)}")
    if math.isfinite(lo) and math.isfinite(hi):
        w = hi - lo
        if inp.lo_open or inp.hi_open:
            a = lo + (_INSET * w if inp.lo_open else 0.0)
            b = hi - (_INSET * w if inp.hi_open else 0.0)
            return f"{_num(a)} + {_num(b - a)} * torch.rand({shape})"
        return f"{_num(lo)} + {_num(w)} * torch.rand({shape})"
    if math.isfinite(lo):
        return f"{_num(lo + (_INSET if inp.lo_open else 0.0))} + torch.randn({shape}).abs()"
    if math.isfinite(hi):
        return f"{_num(hi - (_INSET if inp.hi_open else 0.0))} - torch.randn({shape}).abs()"
    return f"torch.randn({shape})"  # unbounded


def input_lines(mixer) -> list:
    """(name, text) for every input, then every param, in the order they are drawn (the spec's)."""
    return [(i.name, input_line(i)) for i in (*mixer.ir.inputs, *mixer.ir.params)]


def draw_inputs(mixer, case: Case, device="cpu") -> tuple:
    """(inputs {name: fp32 tensor}, options {scale, initial_state, cu_seqlens, output_final_state}).

    Drawn on the CPU with torch.manual_seed(case.seed) (so a case is the same on any device), then
    moved to `device`.
    """
    env = {"torch": torch, "F": F, "B": case.B, "T": case.T, "H": case.H, "HV": case.HV,
           "K": case.K, "V": case.V, "N": case.N}
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(case.seed)
        x = {}
        for name, text in input_lines(mixer):
            # the text is built above from validated identifiers and float literals only
            x[name] = eval(text, env).to(torch.float32)  # noqa: S307
        h0 = torch.randn(case.N, case.HV, case.K, case.V) if case.initial_state else None
    finally:
        torch.random.set_rng_state(gen_state)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int64)
    x = {n: t.to(device) for n, t in x.items()}
    opts = dict(scale=case.scale, initial_state=None if h0 is None else h0.to(device),
                cu_seqlens=None if cu is None else cu.to(device), output_final_state=True)
    return x, opts


def rms_ratio(a: torch.Tensor, b: torch.Tensor) -> float:
    """rms(a - b) / rms(b) in float64 (0 when both are exactly zero; nan when a has nan). Of two
    whole states (MixerState): the worst over S and each auxiliary state."""
    if isinstance(b, MixerState):
        pa, pb = _parts(a), _parts(b)
        if sorted(pa) != sorted(pb):
            return math.inf
        return max(rms_ratio(pa[n], pb[n]) for n in pb)
    a = a.detach().to("cpu", torch.float64)
    b = b.detach().to("cpu", torch.float64)
    num = (a - b).pow(2).mean().sqrt().item() if a.numel() else 0.0
    den = b.pow(2).mean().sqrt().item() if b.numel() else 0.0
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---- one case --------------------------------------------------------------------------------
def implementations(mixer) -> tuple:
    """The kernels to test: recurrent, plus chunk when the Mixer and the generated module have it."""
    impls = ["recurrent"]
    value_side = getattr(getattr(mixer, "ir", None), "side", "left") == "right"  # chunk in PyTorch
    if hasattr(mixer, "chunk") and (value_side or hasattr(mixer.kernels, "chunk")):
        impls.append("chunk")
    return tuple(impls)


@dataclass
class Outcome:
    case: Case
    errors: dict = field(default_factory=dict)  # impl -> (rms ratio of o, of the final state)
    impl: str = ""  # the first failing implementation ("" when all pass)
    message: str = ""
    grad_errors: dict = field(default_factory=dict)  # input name -> rms ratio of its chunk gradient
    grad_failed: bool = False  # the failure is in the gradients (the forward passed)

    @property
    def ok(self) -> bool:
        return not self.impl


def reference(mixer, case: Case):
    """The float64 reference on the CPU for a case: (o, final state)."""
    x, opts = draw_inputs(mixer, case, "cpu")
    x64 = {n: t.double() for n, t in x.items()}
    if opts["initial_state"] is not None:
        opts["initial_state"] = opts["initial_state"].double()
    return mixer.reference(**x64, **opts)


def grad_tol(name: str, tol: float = TOL) -> float:
    """The tolerance of one input's gradient: tol for q, k, v and the initial state, 10 tol else."""
    return tol if name in _QKVH else GATE_GRAD_FACTOR * tol


def draw_upstream(case: Case, device="cpu") -> tuple:
    """(do [B, T, HV, V], dS [N, HV, K, V]): standard normal, drawn with manual_seed(case.seed + 1)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(case.seed + 1)
        do = torch.randn(case.B, case.T, case.HV, case.V)
        dS = torch.randn(case.N, case.HV, case.K, case.V)
    finally:
        torch.random.set_rng_state(gen_state)
    return do.to(device), dS.to(device)


def _gradients(fn, x, h0, opts, do, dS, dtype, device) -> dict:
    """{name: gradient} of (o * do).sum() + (S * dS).sum() (plus a weighted sum of each other part
    of a whole final state) through fn, for every input and h0."""
    leaves = {n: t.detach().to(device, dtype).requires_grad_() for n, t in x.items()}
    if h0 is not None:
        leaves["initial_state"] = h0.detach().to(device, dtype).requires_grad_()
    cu = opts["cu_seqlens"]
    o, s = fn(**leaves, scale=opts["scale"], cu_seqlens=None if cu is None else cu.to(device),
              output_final_state=True)
    loss = (o * do.to(device, dtype)).sum()
    if isinstance(s, MixerState):  # the whole state: each auxiliary part with weights of its own
        gen = torch.Generator().manual_seed(len(s.aux))
        for _, a in sorted(s.aux.items()):
            loss = loss + (a * torch.randn(a.shape, generator=gen, dtype=torch.float64).to(device, dtype)).sum()
        s = s.S
    loss = loss + (s * dS.to(device, dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return dict(zip(leaves, grads))


def check_grads(mixer, case: Case, device="cpu", tol: float = TOL) -> tuple:
    """Chunk gradients against float64 autograd through the reference: ({name: ratio}, message);
    the message is "" when every gradient is within its tolerance."""
    x, opts = draw_inputs(mixer, case, "cpu")
    h0 = opts["initial_state"]
    tol = case_tolerance(mixer, case, tol)  # offline solves: CG's, from the case's condition number
    do, dS = draw_upstream(case, "cpu")
    ref = _gradients(mixer.reference, x, h0, opts, do, dS, torch.float64, "cpu")
    got = _gradients(mixer.chunk, x, h0, opts, do, dS, torch.float32, device)
    scale = max(_rms(ref[n]) for n in ("q", "k", "v"))
    errors, bad = {}, []
    for name, g in ref.items():
        c = got[name]
        if c is None or tuple(c.shape) != tuple(g.shape):
            errors[name] = math.inf
            bad.append(f"d{name}: " + ("no gradient" if c is None else f"shape {list(c.shape)}, "
                                       f"expected {list(g.shape)}"))
            continue
        if _rms(g) == 0.0 and scale > 0.0:  # an exact zero in float64: compare absolutely
            errors[name] = _rms(c) / scale
        else:
            errors[name] = rms_ratio(c, g)
        if not errors[name] < grad_tol(name, tol):  # nan fails too
            bad.append(f"d{name} {errors[name]:.3g} (tolerance {grad_tol(name, tol):g})")
    message = ""
    if bad:
        message = "chunk gradients: rms ratio " + ", ".join(bad)
    return errors, message


def _parts(state) -> dict:
    """A final state as {name: tensor}: S, and each auxiliary state of a whole state."""
    if state is None:
        return {}
    if isinstance(state, MixerState):
        return {"S": state.S, **state.aux}
    return {"S": state}


def _rms(t) -> float:
    t = t.detach().to("cpu", torch.float64)
    return t.pow(2).mean().sqrt().item() if t.numel() else 0.0


def check_case(mixer, case: Case, device="cpu", impls=None, tol: float = TOL, grad: bool = False) -> Outcome:
    """Run every implementation on a case and compare with the reference; with grad, also the
    chunked kernels' gradients (when chunk is among impls). Never raises for a kernel's failure:
    an exception becomes a failing Outcome with its message."""
    out = Outcome(case)
    impls = implementations(mixer) if impls is None else impls
    tol = case_tolerance(mixer, case, tol)  # offline solves: CG's, from the case's condition number
    ref_o, ref_s = reference(mixer, case)
    for impl in impls:
        try:
            x, opts = draw_inputs(mixer, case, device)
            o, s = getattr(mixer, impl)(**x, **opts)
        except Exception as e:  # a kernel that does not run is a failure of this case
            out.impl, out.message = impl, f"{impl} raised {type(e).__name__}: {e}"
            return out
        got, want = _parts(s), _parts(ref_s)
        if tuple(o.shape) != tuple(ref_o.shape) or {n: t.shape for n, t in got.items()} != \
                {n: t.shape for n, t in want.items()}:
            shapes = {n: list(t.shape) for n, t in got.items()}
            out.impl, out.message = impl, (f"{impl}: o {list(o.shape)} and state {shapes or None}, expected "
                                           f"{list(ref_o.shape)} and {({n: list(t.shape) for n, t in want.items()})}")
            return out
        e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)  # (of a whole state: its worst part)
        out.errors[impl] = (e_o, e_s)
        if not (e_o < tol and e_s < tol):  # nan fails too
            out.impl = impl
            out.message = f"{impl}: rms ratio o {e_o:.3g}, final state {e_s:.3g} (tolerance {tol:g})"
            return out
    if grad and "chunk" in impls:
        try:
            out.grad_errors, message = check_grads(mixer, case, device, tol)
        except Exception as e:  # a backward that does not run is a failure of this case
            out.grad_errors, message = {}, f"chunk backward raised {type(e).__name__}: {e}"
        if message:
            out.impl, out.message, out.grad_failed = "chunk", message, True
    return out


# ---- the snippet -----------------------------------------------------------------------------
def snippet(mixer, case: Case, impl: str = "recurrent", device: str = "cpu", tol: float = TOL,
            grad: bool = False) -> str:
    """A standalone Python script that rebuilds a case, runs `impl` and the reference, compares;
    with grad (impl chunk), then the gradients of every input and of the initial state too."""
    filename = getattr(mixer, "filename", "<spec>")
    if filename != "<spec>" and os.path.isfile(filename):
        load = f"mixer = lrdsl.compile({os.path.abspath(filename)!r})"
    else:
        load = f"mixer = lrdsl.compile(text={mixer.source!r})"
    lines = [f"# lrdsl fuzz: a failing case of {mixer.name} ({impl} vs the float64 reference)"]
    if device == "cpu":
        lines += ["import os", "", "os.environ[\"TRITON_INTERPRET\"] = \"1\"  # CPU: Triton's interpreter; "
                  "set before triton is imported"]
    lines += ["import torch", "import torch.nn.functional as F", "", "import lrdsl", "",
              load, f"device = {device!r}",
              f"B, T, H, HV, K, V = {case.B}, {case.T}, {case.H}, {case.HV}, {case.K}, {case.V}",
              f"N = {case.N}", f"torch.manual_seed({case.seed})", "x = {}"]
    lines += [f"x[{name!r}] = {text}" for name, text in input_lines(mixer)]
    lines.append(f"initial_state = {'torch.randn(N, HV, K, V)' if case.initial_state else 'None'}")
    cu = "None" if case.cu_seqlens is None else f"torch.tensor({list(case.cu_seqlens)}, dtype=torch.int64)"
    lines += [f"cu_seqlens = {cu}",
              f"opts = dict(scale={case.scale!r}, cu_seqlens=cu_seqlens, output_final_state=True)",
              "",
              "",
              "def rms_ratio(a, b):",
              "    a, b = a.detach().cpu().double(), b.detach().cpu().double()",
              "    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()",
              "",
              "",
              "h0_64 = None if initial_state is None else initial_state.double()",
              "ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()}, initial_state=h0_64, "
              "**opts)",
              "x_dev = {n: t.to(device) for n, t in x.items()}",
              "h0_dev = None if initial_state is None else initial_state.to(device)",
              "cu_dev = None if cu_seqlens is None else cu_seqlens.to(device)",
              f"o, s = mixer.{impl}(**x_dev, initial_state=h0_dev, **dict(opts, cu_seqlens=cu_dev))",
              "parts = lambda st: {'S': st.S, **st.aux} if isinstance(st, lrdsl.MixerState) else {'S': st}",
              "err_o = rms_ratio(o, ref_o)",
              "err_s = max(rms_ratio(parts(s)[n], t) for n, t in parts(ref_s).items())",
              "print(f\"rms ratio: o {err_o:.3g}, final state {err_s:.3g}\")",
              f"assert err_o < {tol!r} and err_s < {tol!r}, (err_o, err_s)",
              ""]
    if grad:
        lines += ["# gradients of loss = (o * do).sum() + (S * dS).sum(): the kernels (fp32) vs float64 "
                  "autograd through the reference",
                  f"torch.manual_seed({case.seed + 1})",
                  "do, dS = torch.randn(B, T, HV, V), torch.randn(N, HV, K, V)",
                  "",
                  "",
                  "def grads(fn, dtype, dev):",
                  "    leaves = {n: t.to(dev, dtype).requires_grad_() for n, t in x.items()}",
                  "    if initial_state is not None:",
                  "        leaves['initial_state'] = initial_state.to(dev, dtype).requires_grad_()",
                  "    cu = None if cu_seqlens is None else cu_seqlens.to(dev)",
                  "    o, s = fn(**leaves, **dict(opts, cu_seqlens=cu))",
                  "    loss = (o * do.to(dev, dtype)).sum()",
                  "    if isinstance(s, lrdsl.MixerState):  # each auxiliary part with weights of its own",
                  "        gen = torch.Generator().manual_seed(len(s.aux))",
                  "        for _, a in sorted(s.aux.items()):",
                  "            loss = loss + (a * torch.randn(a.shape, generator=gen, dtype=torch.float64)"
                  ".to(dev, dtype)).sum()",
                  "        s = s.S",
                  "    loss = loss + (s * dS.to(dev, dtype)).sum()",
                  "    found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)",
                  "    return dict(zip(leaves, found))",
                  "",
                  "",
                  "ref = grads(mixer.reference, torch.float64, 'cpu')",
                  f"got = grads(mixer.{impl}, torch.float32, device)",
                  "scale = max(ref[n].pow(2).mean().sqrt().item() for n in ('q', 'k', 'v'))",
                  "bad = []",
                  "for n, g in ref.items():",
                  "    assert got[n] is not None, f'no gradient for {n}'",
                  "    zero = g.pow(2).mean().sqrt().item() == 0.0  # an exact zero: compare absolutely",
                  "    err = got[n].double().cpu().pow(2).mean().sqrt().item() / scale if zero else "
                  "rms_ratio(got[n], g)",
                  f"    tol = {tol!r} if n in {_QKVH!r} else {GATE_GRAD_FACTOR * tol!r}",
                  "    print(f'd{n}: rms ratio {err:.3g} (tolerance {tol:g})')",
                  "    if not err < tol:",
                  "        bad.append(n)",
                  "assert not bad, f'gradients off: {bad}'",
                  ""]
    return "\n".join(lines)


def case_tolerance(mixer, case, tol: float) -> float:
    """lrdsl fuzz's tolerance for a case: tol, or for an offline solve cg_tolerance with the case's
    own condition-number bound."""
    if mixer.ir.solve_lam is None:
        return tol
    x, opts = draw_inputs(mixer, case, "cpu")
    batch = mixer._validate(x["q"], x["k"], x["v"], {n: t for n, t in x.items() if n not in ("q", "k", "v")},
                            opts["scale"], None, False, opts["cu_seqlens"])
    return cg_tolerance(mixer.ir.solve_steps, case.K, kappa_bound(mixer.ir, batch), tol)
