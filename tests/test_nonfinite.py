"""Causality for non-finite inputs (issue 9): a nan or inf at token t of a sequence leaves every
token before it, and every other sequence, as the float64 reference has them; from t on the
outputs are finite exactly where the reference's are (entry by entry: an inf in one value channel
spoils that channel only).

The chunked kernels mix a chunk's tokens through triangular products on tensor cores, inside which
0 * nan is nan: without care a bad token spoils the whole chunk (common.jinja's nonfinite_helpers).
Triton's interpreter takes tl.minimum / tl.maximum as numpy's nan-propagating ones, where a GPU
returns the other operand (minnum); on the CPU the kernels run both ways ("gpu" patches the
interpreter to fmin / fmax).
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from specgen import axis_specs
from test_recurrent import DEVICE, EXAMPLES, PoisonTorch, chunk_modules, general_kernels, state_parts

import lrdsl
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

OFFLINE = EXAMPLES[0].parent / "mesa.lr"  # the offline solve's own kernels
MIXERS = {  # name: (spec, compile options); "-general": the general kernels (general_kernels), kept
    "gated_deltanet": ("gated_deltanet", {}),
    "kda": ("kda", {}),
    "gla": ("gla", {}),
    "mamba2": ("mamba2", {}),
    "gdn2_atk": ("gdn2_atk", {}),
    "kda_decay_after_erase": ("kda_decay_after_erase", {}),
    "gated_deltanet-general": ("gated_deltanet", {"keep_intermediates": True}),
    "mesa": ("mesa", {}),
    "comba": ("comba", {}),  # the erase reads p, the write k: the fused solve takes both tiles
}
# (input, value, whole token or one entry of one head): nan in a decay, inf in one value entry, nan in a key
BAD = {"g-nan": ("g", math.nan, True), "v-inf": ("v", math.inf, False), "k-nan": ("k", math.nan, True)}
# the bad token's place in the second of two packed sequences: inside a 64-token chunk (and a
# 16-token block), and at the start of the sequence's second chunk
WHERE = {"t37": 37, "t64": 64}
SEMANTICS = ["gpu", "numpy"] if DEVICE == "cpu" else ["device"]
# pytest -q runs one bad input per mixer, inside a chunk, with the GPU's semantics; -m slow the rest
DEFAULT = {("gated_deltanet", "g-nan"), ("kda", "v-inf"), ("gla", "k-nan"), ("mamba2", "v-inf"),
           ("gdn2_atk", "g-nan"), ("kda_decay_after_erase", "k-nan"), ("gated_deltanet-general", "v-inf"),
           ("mesa", "g-nan"), ("comba", "k-nan")}
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]


class FinitePoison(PoisonTorch):
    """PoisonTorch with a finite poison: an element the kernels never write reads 1e30, not nan,
    so it cannot pass for one of the nans this module expects."""

    def _poison(self, t):
        if t.is_floating_point():
            t.fill_(1e30)
            self.poisoned += 1
        return t


@pytest.fixture
def semantics(request, monkeypatch):
    if request.param == "gpu":
        from triton.runtime import interpreter
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_minnumf",
                            lambda self, a, b: self.binary_op(a, b, np.fmin))
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_maxnumf",
                            lambda self, a, b: self.binary_op(a, b, np.fmax))
    return request.param


def spec_path(stem):
    return OFFLINE if stem == "mesa" else next(p for p in EXAMPLES if p.stem == stem)


def spoil(x, name, value, whole, row):
    """A copy of the inputs with `value` at packed row `row` of input `name` (every head and
    channel, or one entry of the first head)."""
    x = dict(x)
    t = x[name].clone()
    if whole:
        t[0, row] = value
    else:
        t[0, row].view(-1)[3] = value
    x[name] = t
    return x


def check_causal(mixer, x, opts, first_bad, monkeypatch, label):
    """chunk's o and final state against the float64 reference: the same finite / non-finite
    pattern, rms ratio < TOL over the finite entries, and every token before first_bad finite."""
    poison = FinitePoison()
    for module in chunk_modules(mixer):
        monkeypatch.setattr(module, "torch", poison)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert poison.poisoned >= 2
    h0 = opts["initial_state"]
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in x.items()},
                                   **dict(opts, initial_state=h0.double() if torch.is_tensor(h0) else h0))
    assert torch.isfinite(ref_o[0, :first_bad]).all() and not torch.isfinite(ref_o[0, first_bad:]).all(), label
    assert torch.isfinite(o[0, :first_bad]).all(), f"{label}: nan before the bad token"
    pairs = {"o": (o, ref_o), **{"S" + n: (t, state_parts(ref_s)[n]) for n, t in state_parts(s).items()}}
    for part, (got, ref) in pairs.items():
        fin = torch.isfinite(ref)
        wrong = (torch.isfinite(got) != fin).nonzero()
        assert not len(wrong), f"{label}: {part} finite where the reference is not, or not where it is, at {wrong[:4].tolist()}"
        err = rms_ratio(got[fin], ref[fin])
        assert err < TOL, f"{label}: {part} rms ratio {err:.3g} over its finite entries"


def check_earlier_dq(mixer, x, opts, case, row, label):
    """dq of the tokens before `row` (a loss on those tokens only), kernels in fp32 against the
    float64 reference: finite and within TOL."""
    do = torch.randn(1, case.T, 1, case.V, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    do[:, row:] = 0

    def dq(fn, dtype):
        q = x["q"].to(dtype).requires_grad_()
        o, _ = fn(**{n: t.to(dtype) for n, t in x.items() if n != "q"}, q=q, **opts)
        (torch.nan_to_num(o, nan=0.0, posinf=0.0, neginf=0.0) * do.to(dtype)).sum().backward()
        return q.grad[0, :row]

    ref = dq(mixer.reference, torch.float64)
    got = dq(mixer.chunk, torch.float32)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(got).all(), f"{label}: dq is not finite before row {row}"
    assert rms_ratio(got, ref) < TOL


def matrix():
    """Every mixer and bad input; each pair's (row, semantics) cases alternate (half of them under -m
    slow, every row and semantics met by every mixer), the DEFAULT pairs' first in pytest -q."""
    pairs = [(m, b) for m in MIXERS for b in BAD]
    for i, (m, b) in enumerate(pairs):
        for j, (w, sem) in enumerate((w, sem) for w in WHERE for sem in SEMANTICS):
            default = (m, b) in DEFAULT and w == "t37" and sem == SEMANTICS[0]
            if default or (i + j) % 2 == 0:
                yield pytest.param(m, b, w, sem, marks=() if default else pytest.mark.slow,
                                   id=f"{m}-{b}-{w}-{sem}")


@pytest.mark.parametrize("mixer_id,bad,where,semantics", matrix(), indirect=["semantics"])
def test_nonfinite_input_reaches_no_earlier_token(mixer_id, bad, where, semantics, compiled, monkeypatch):
    stem, options = MIXERS[mixer_id]
    mixer = compiled(spec_path(stem), check_ranges=False, **options)
    if mixer_id.endswith("-general"):
        general_kernels(mixer, monkeypatch)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=9)
    x, opts = draw_inputs(mixer, case, DEVICE)
    name, value, whole = BAD[bad]
    row = 20 + WHERE[where]
    check_causal(mixer, spoil(x, name, value, whole, row), opts, row, monkeypatch, f"{mixer_id} {bad} {where}")


@pytest.mark.parametrize("where", ["t37", pytest.param("t64", marks=pytest.mark.slow)])
def test_nonfinite_erase_read_of_its_own_reaches_no_earlier_token(where, compiled, monkeypatch):
    """comba's erase direction p, an input of its own beside the write key k (the fused solve's
    second tile): nan in it on one token, with the GPU's semantics."""
    mixer = compiled(spec_path("comba"), check_ranges=False)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=9)
    x, opts = draw_inputs(mixer, case, DEVICE)
    row = 20 + WHERE[where]
    check_causal(mixer, spoil(x, "p", math.nan, True, row), opts, row, monkeypatch, f"comba p-nan {where}")


# nan in one key channel of a per-channel decay, not the whole token: a 16-token block then decays
# by nan in that channel only, which tl.max over the channels dropped on a GPU, so the block took
# the tensor-core path and its products spread the nan to its earlier tokens. "-native": the
# native forward of a decay after the erase (LRDSL_NATIVE_RANK2=1)
CHANNEL = ["gla", "kda", "kda_decay_after_erase", "kda_decay_after_erase-native"]


@pytest.mark.parametrize("semantics", SEMANTICS, indirect=True)
@pytest.mark.parametrize("mixer_id", [pytest.param(m, marks=() if m in ("gla", "kda_decay_after_erase-native") else
                                                   pytest.mark.slow) for m in CHANNEL])
def test_nan_in_one_key_channel_of_the_decay_reaches_no_earlier_token(mixer_id, semantics, compiled, monkeypatch):
    if mixer_id.endswith("-native"):
        monkeypatch.setenv("LRDSL_NATIVE_RANK2", "1")
    mixer = compiled(spec_path(mixer_id.removesuffix("-native")), check_ranges=False)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=10)
    x, opts = draw_inputs(mixer, case, DEVICE)
    row = 20 + 57  # inside the 16-token block from 48 of the second sequence
    check_causal(mixer, spoil(x, "g", math.nan, False, row), opts, row, monkeypatch, f"{mixer_id} g-nan in one channel")


def test_causal_nonfinite_off_spreads_nan_over_the_chunk(monkeypatch):
    """Canary for the test above: with the plan's causal_nonfinite off the products are plain and a
    nan at token 37 reaches the tokens before it (so the test can fail)."""
    import dataclasses

    import lrdsl.codegen.generate as generate_module  # the plan lrdsl.compile renders
    plain = generate_module.plan
    monkeypatch.setattr(generate_module, "plan", lambda m: dataclasses.replace(plain(m), causal_nonfinite=False))
    mixer = lrdsl.compile(spec_path("gated_deltanet"), check_ranges=False)
    x, opts = draw_inputs(mixer, Case(B=1, T=64, H=1, HV=1, K=16, V=16, seed=9), DEVICE)
    x["g"][0, 37] = math.nan
    with torch.no_grad():
        o, _ = mixer.chunk(**x, **opts)
    assert not torch.isfinite(o[0, :37]).all()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=axis_specs(), data=st.data())
def test_random_spec_nonfinite_input_reaches_no_earlier_token(text, data, monkeypatch):
    mixer = lrdsl.compile(text=text, check_ranges=False)
    case = Case(B=1, T=90, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 10, 90), initial_state=True,
                seed=data.draw(st.integers(0, 2**16)))
    x, opts = draw_inputs(mixer, case, DEVICE)
    name = data.draw(st.sampled_from(sorted(x)), label="input")
    value = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]), label="value")
    row = 10 + data.draw(st.integers(1, 79), label="t")
    x = spoil(x, name, value, True, row)
    ref_o = mixer.reference(**{n: t.double() for n, t in x.items()},
                            **dict(opts, initial_state=opts["initial_state"].double()))[0]
    if torch.isfinite(ref_o).all():  # clamped into its range (beta = inf) or a reset (g = -inf)
        return
    check_causal(mixer, x, opts, row, monkeypatch, f"{name}={value} at {row}\n{text}")


# the staged backward's dq (dr): a bad key or decay at token t leaves dq of the tokens before it as
# the reference has them (the products over key tokens are causal, as in the forward)
BACKWARD = [("gated_deltanet", "k-nan"), ("gated_deltanet", "g-nan"), ("kda", "k-nan"), ("kda", "g-nan")]


@pytest.mark.parametrize("semantics", SEMANTICS[:1], indirect=True)  # the GPU's minnum on a CPU
@pytest.mark.parametrize("stem,bad", BACKWARD, ids=[f"{s}-{b}" for s, b in BACKWARD])
def test_nonfinite_input_leaves_earlier_dq(stem, bad, semantics, compiled):
    mixer = compiled(spec_path(stem), check_ranges=False)
    case = Case(B=1, T=100, H=1, HV=1, K=16, V=16, cu_seqlens=None, initial_state=False, seed=4)
    x, opts = draw_inputs(mixer, case, DEVICE)
    row = 37
    name, value, whole = BAD[bad]
    x = spoil(x, name, value, whole, row)
    check_earlier_dq(mixer, x, opts, case, row, f"{stem} {bad}")
