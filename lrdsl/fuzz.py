"""Differential fuzzing: the generated kernels against the float64 reference, on random shapes and inputs.

Hypothesis draws a `Case` (sizes, packed sequences, initial state, scale and an input seed); the
inputs of the mixer are then drawn with `torch.manual_seed(case.seed)` inside the ranges the spec
declares (log-decays <= 0, `in (lo, hi)` uniform strictly inside an open end, unit vectors of unit
norm, the rest standard normal). Every implementation the generated module has (`recurrent`, and
`chunk` when both the Mixer and the module define it) runs in fp32 and is compared with the
reference run on float64 copies of the same inputs:

    rms(kernel - reference) / rms(reference) < 1e-4   for o and for the final state.

An offline solve (Mesa), whose kernels solve by conjugate gradients, takes per case CG's tolerance
instead (lrdsl.runtime.offline.cg_tolerance: fp32 rounding times a bound on the case's condition number, plus
CG's rate when the steps are fewer than K), never below 1e-4, for the forward and the gradients.

With gradients on (the default of `run_fuzz` and `lrdsl fuzz`; `--no-grad` turns them off), the
chunked kernels (the only differentiable ones: `recurrent` is forward-only) are also
differentiated for loss = (o * do).sum() + (S * dS).sum(), with random do and dS drawn with
`torch.manual_seed(case.seed + 1)` (and, for a whole state, a term like the second for each of its
other parts, weights from torch.Generator().manual_seed(number of parts)), and every input's
gradient and the initial state's is compared with float64 autograd through the reference:

    rms ratio < tol (1e-4) for q, k, v and the initial state;  < 10 tol (1e-3) for the other inputs.

A gradient that is exactly zero in float64 (e.g. a decay that only multiplies a zero state) is
compared absolutely instead: rms(kernel gradient) / (largest rms of dq, dk, dv in float64).

A failing case is shrunk by Hypothesis and rendered as a runnable Python snippet. Each input is
drawn by one line of Python text (`input_lines`), which is both evaluated here and printed into the
snippet, so the snippet rebuilds exactly the tensors that failed.

CPU runs go through Triton's interpreter: TRITON_INTERPRET=1 must be set before triton is imported
(the `lrdsl fuzz` command does it; tests set it in conftest.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from lrdsl.errors import LrdslError
from lrdsl.testing import _QKVH, GATE_GRAD_FACTOR, TOL, Case, case_tolerance, check_case, implementations, snippet


# ---- the Hypothesis driver -------------------------------------------------------------------
def cases(max_T: int = 70, min_KV: int = 16, max_KV: int = 32):
    """Hypothesis strategy of Cases: B 1-2, T 1-max_T, H 1-2, HV = H or 2H, K and V in
    [min_KV, max_KV], packed sequences (cu_seqlens, empty ones included) on or off, initial state
    on or off, the default scale or a random one, and an input seed."""
    from hypothesis import strategies as st

    size = st.one_of(st.sampled_from(sorted({min_KV, 20, max_KV} & set(range(min_KV, max_KV + 1)))),
                     st.integers(min_KV, max_KV))

    @st.composite
    def draw_case(draw):
        varlen = draw(st.booleans())
        B = 1 if varlen else draw(st.integers(1, 2))
        T = draw(st.integers(1, max_T))
        cu = None
        if varlen:
            cuts = draw(st.lists(st.integers(0, T), max_size=3))
            cu = (0, *sorted(cuts), T)
        H = draw(st.integers(1, 2))
        HV = H * draw(st.sampled_from((1, 2)))
        K, V = draw(size), draw(size)
        init = draw(st.booleans())
        scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0, allow_nan=False, allow_infinity=False)))
        seed = draw(st.integers(0, 2**31 - 1))
        return Case(B, T, H, HV, K, V, cu, init, scale, seed)

    return draw_case()


@dataclass
class Failure:
    case: Case
    impl: str
    message: str
    snippet: str


@dataclass
class FuzzResult:
    mixer: str
    device: str
    impls: tuple
    examples: int  # cases drawn and checked before the first failure (all of them on success)
    runs: int  # calls in all, shrinking included
    seconds: float
    worst: dict  # impl -> (worst o ratio, worst state ratio) over passing runs
    failure: Failure | None = None
    tol: float = TOL
    grad: bool = False  # chunk gradients were checked too
    worst_grad: dict = field(default_factory=dict)  # input name -> worst gradient ratio over passing runs
    cg: bool = False  # an offline solve: each case's tolerance is also bounded below by CG's

    @property
    def ok(self) -> bool:
        return self.failure is None

    def summary(self) -> str:
        worst = "; ".join(f"{i} worst rms ratio o {o:.2g}, state {s:.2g}" for i, (o, s) in self.worst.items())
        if self.grad and self.worst_grad:
            qkvh = max((e for n, e in self.worst_grad.items() if n in _QKVH), default=0.0)
            gates = [e for n, e in self.worst_grad.items() if n not in _QKVH]
            worst += f"; chunk gradients worst rms ratio q, k, v, h0 {qkvh:.2g}"
            if gates:
                worst += f", other inputs {max(gates):.2g} (tolerance {GATE_GRAD_FACTOR * self.tol:g})"
        if self.ok:
            checked = ", ".join(self.impls) + (" and chunk gradients" if self.grad else "")
            return (f"fuzz {self.mixer}: {self.examples} examples passed on {self.device} "
                    f"({checked} vs float64 reference, tolerance {self.tol:g}"
                    f"{' or CG bound of each case, whichever is larger' if self.cg else ''}) in "
                    f"{self.seconds:.1f}s; {worst}")
        return (f"fuzz {self.mixer}: FAILED on {self.device} after {self.examples} examples "
                f"({self.runs} runs with shrinking): {self.failure.message}")


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def run_fuzz(mixer, examples: int = 50, device: str | None = None, seed: int | None = None,
             progress=None, strategy=None, tol: float = TOL, grad: bool = True) -> FuzzResult:
    """Check `examples` Hypothesis-drawn cases; shrink the first failure and render its snippet.
    With grad (the default), the chunked kernels' gradients are checked too (see the module doc).

    progress(done, total, shrinking) is called after every run. With a seed the run is
    reproducible (Hypothesis seeded and derandomized).
    """
    try:
        from hypothesis import HealthCheck, Phase, Verbosity, given, settings
        from hypothesis import seed as hseed
    except ImportError:
        raise LrdslError("fuzzing needs hypothesis: pip install hypothesis") from None
    device = device or default_device()
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise LrdslError("fuzzing on the CPU runs Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "triton is imported")
    if device == "cuda" and not torch.cuda.is_available():
        raise LrdslError("--device cuda: torch sees no CUDA device")
    if examples < 1:
        raise LrdslError(f"the number of examples must be at least 1, got {examples}")
    impls = implementations(mixer)
    st_cases = strategy if strategy is not None else cases()
    # every path asserts that the drawn inputs lie in their declared ranges (what is drawn
    # outside them would test the clamp, not the mixer)
    mixer.check_ranges, ranges_before = True, mixer.check_ranges
    state = {"runs": 0, "passed": 0, "last": None}
    worst = {i: (0.0, 0.0) for i in impls}
    grad = bool(grad and "chunk" in impls)
    worst_grad = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              verbosity=Verbosity.quiet, phases=(Phase.generate, Phase.shrink),
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(st_cases)
    def prop(case):
        out = check_case(mixer, case, device, impls, tol, grad)
        state["runs"] += 1
        if out.ok:
            if state["last"] is None:
                state["passed"] += 1
            for i, (e_o, e_s) in out.errors.items():
                worst[i] = (max(worst[i][0], e_o), max(worst[i][1], e_s))
            for n, e in out.grad_errors.items():
                worst_grad[n] = max(worst_grad.get(n, 0.0), e)
        else:
            state["last"] = out
        if progress is not None:
            progress(state["passed"], examples, state["last"] is not None)
        if not out.ok:
            raise AssertionError(out.message)  # one raise site: Hypothesis sees one bug

    if seed is not None:
        prop = hseed(seed)(prop)
    start = time.perf_counter()
    try:
        prop()
    except Exception:
        if state["last"] is None:
            raise
    finally:
        mixer.check_ranges = ranges_before
    seconds = time.perf_counter() - start
    failure = None
    if state["last"] is not None:  # Hypothesis replays the shrunk case last
        last = state["last"]
        failure = Failure(last.case, last.impl, last.message,
                          snippet(mixer, last.case, last.impl, device, case_tolerance(mixer, last.case, tol),
                                  last.grad_failed))
    return FuzzResult(mixer.name, device, impls, state["passed"], state["runs"], seconds, worst, failure, tol,
                      grad, worst_grad, cg=mixer.ir.solve_lam is not None)
