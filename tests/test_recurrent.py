"""The fused recurrent kernel against the float64 reference: every example spec on odd shapes, with
its outputs poisoned (NaN) before the launch, and a Hypothesis test over random axis-form specs.

Tolerance: rms(kernel - reference) / rms(reference) < 1e-4 for o and the final state (fp32 inputs).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specgen import axis_specs, default_first, example_params, kernel_examples

import lrdsl
from lrdsl.testing import TOL, Case, check_case, draw_inputs, rms_ratio

EXAMPLES = kernel_examples()  # every example but the offline solve (reference only)
DEVICE = "cuda" if os.environ.get("LRDSL_TEST_DEVICE") == "cuda" else "cpu"

# Odd shapes: T not a multiple of 16, K and V not powers of two (V < 16), HV = 2H, an initial state;
# the second case packs three sequences, one of them empty.
CASES = {
    "B2-T37-H1-HV2-K20-V12-h0": Case(B=2, T=37, H=1, HV=2, K=20, V=12, initial_state=True, scale=0.7, seed=1),
    "varlen-T37-H2-HV4-K20-V12-h0": Case(B=1, T=37, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 5, 5, 37),
                                         initial_state=True, seed=2),
}


def state_parts(state) -> dict:
    """A final state as {name: tensor}: S, and the auxiliary states of a whole state."""
    if isinstance(state, lrdsl.MixerState):
        return {"S": state.S, **state.aux}
    return {"S": state}


def chunk_modules(mixer) -> list:
    """The generated modules chunk may launch: the mixer's own, and its split mixer's (lrdsl/codegen/split.py),
    or a value side's on the key side's staged kernels (runtime/value_key.py)."""
    if getattr(mixer, "value_transposed", None) is not None:
        from lrdsl.runtime.value_key import modules
        return [mixer.kernels, *modules(mixer.value_transposed)]
    return [mixer.kernels] + ([mixer.split.kernels] if mixer.split is not None else [])


def recurrent_module(mixer):
    """The generated module recurrent launches: the mixer's own, or where its readout reads the
    state before the update, its first part's (Mixer._with_before runs the readout around the parts'
    kernels; chunk may read it in the mixer's own, Mixer._fused)."""
    if mixer.ir.reads_before:
        return next(p for p in mixer._parts[:2] if p is not None).kernels
    return mixer.kernels


def general_kernels(mixer, monkeypatch):
    """The mixer, its chunk (forward and backward, keep_intermediates or not) sent to the general
    kernels for this test: the staged ones serve keys up to STAGED_MAX_K, here none (nor the split's,
    so the original spec's general kernels run)."""
    for module in chunk_modules(mixer):
        monkeypatch.setattr(module, "STAGED_MAX_K", 0)
    return mixer


class PoisonTorch:
    """Stands in for `torch` inside a generated module: every tensor it allocates with empty /
    empty_like starts as NaN, so an element the kernel never writes shows up as NaN."""

    def __init__(self):
        self.poisoned = 0

    def __getattr__(self, name):
        return getattr(torch, name)

    def _poison(self, t):
        if t.is_floating_point():
            t.fill_(math.nan)
            self.poisoned += 1
        return t

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


# pytest -q: every other example, the ones test_chunk's per-example forward leaves to -m slow (each
# example meets one of the two forward tests, and test_backward's, by default); all under -m slow
OTHER_HALF = [pytest.param(*p.values, id=p.id, marks=p.marks or (() if i % 2 else pytest.mark.slow))
              for i, p in enumerate(example_params(EXAMPLES))]


@pytest.mark.parametrize("case_id", default_first(list(CASES), "varlen-T37-H2-HV4-K20-V12-h0"))
@pytest.mark.parametrize("spec", OTHER_HALF)
def test_example_recurrent_matches_reference(spec, case_id, compiled, monkeypatch):
    mixer = compiled(spec)
    case = CASES[case_id]
    poison = PoisonTorch()
    monkeypatch.setattr(recurrent_module(mixer), "torch", poison)  # o and the final state start as NaN
    x, opts = draw_inputs(mixer, case, DEVICE)
    o, s = mixer.recurrent(**x, **opts)
    assert poison.poisoned >= 2, ("the generated module no longer allocates o and the final state with "
                                  "torch.empty: update PoisonTorch so the outputs are still poisoned")
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()},
                                   **dict(opts, initial_state=opts["initial_state"].double()))
    assert o.shape == ref_o.shape and o.dtype == torch.float32
    assert {n: t.shape for n, t in state_parts(s).items()} == {n: t.shape for n, t in state_parts(ref_s).items()}
    assert state_parts(s)["S"].shape == (case.N, case.HV, case.K, case.V)
    assert not o.isnan().any(), f"{o.isnan().sum().item()} elements of o were never written"
    for n, t in state_parts(s).items():
        assert not t.isnan().any(), f"{t.isnan().sum().item()} elements of the final {n} were never written"
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{spec.stem} {case_id}: rms ratio o {e_o:.3g}, state {e_s:.3g}"


def test_poison_is_seen_when_the_kernel_writes_nothing(compiled, monkeypatch):
    """Canary for the test above: with the launch replaced by a no-op, o and the state stay NaN."""
    mixer = compiled(EXAMPLES[0])
    if not hasattr(mixer.kernels, "recurrent_fwd_kernel"):
        pytest.skip("the generated module has no recurrent_fwd_kernel to stub out")

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    poison = PoisonTorch()
    monkeypatch.setattr(mixer.kernels, "torch", poison)
    monkeypatch.setattr(mixer.kernels, "recurrent_fwd_kernel", NoLaunch())
    x, opts = draw_inputs(mixer, CASES["B2-T37-H1-HV2-K20-V12-h0"], DEVICE)
    o, s = mixer.recurrent(**x, **opts)
    assert o.isnan().all() and s.isnan().all()


def test_example_without_final_state_returns_none(compiled):
    mixer = compiled(EXAMPLES[0])
    x, opts = draw_inputs(mixer, Case(B=1, T=3, H=1, HV=1, K=16, V=16), DEVICE)
    o, s = mixer.recurrent(**x, **dict(opts, output_final_state=False))
    assert s is None and o.shape == (1, 3, 1, 16)


# ---- random axis-form specs ------------------------------------------------------------------
def small_cases():
    return st.builds(
        lambda T, H, G, K, V, varlen, cut, init, seed: Case(
            B=1 if varlen else 2, T=T, H=H, HV=H * G, K=K, V=V,
            cu_seqlens=(0, min(cut, T), T) if varlen else None, initial_state=init, seed=seed),
        T=st.integers(1, 40), H=st.integers(1, 2), G=st.sampled_from((1, 2)),
        K=st.sampled_from((16, 20, 32)), V=st.sampled_from((12, 16, 24)), varlen=st.booleans(),
        cut=st.integers(0, 40), init=st.booleans(), seed=st.integers(0, 2**16))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(text=axis_specs(), case=small_cases())
def test_random_axis_spec_recurrent_matches_reference(text, case):
    mixer = lrdsl.compile(text=text)
    out = check_case(mixer, case, DEVICE, impls=("recurrent",))
    assert out.ok, f"{out.message}\nspec:\n{text}case: {case}"
