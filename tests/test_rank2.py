"""The native staged forward of a decay after the erase (plan.rank2, templates/staged_rank2.py.jinja):
asked for (LRDSL_NATIVE_RANK2=1), Mixer.chunk without gradients runs it on 64-token chunks instead of
the split (two tokens per token).
Each test counts the launches: the native kernels ran and the split's did not (or the other way
round where the split must serve). Float64 reference, rms(a - b) / rms(b) < TOL, fresh inputs."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from specgen import rendered_ir
from test_backward import count_launches
from test_chunk import check_fp16, reference
from test_nonfinite import check_causal, spoil
from test_recurrent import DEVICE, EXAMPLES, PoisonTorch, chunk_modules

import lrdsl
from lrdsl.api import Mixer
from lrdsl.codegen.plan import plan
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

NATIVE = ("rank2_pairs_kernel", "rank2_solve_kernel", "rank2_state_kernel", "rank2_output_kernel")
# a decay per token after the erase: the frontend writes it in left order (a number commutes with
# the erase), so the right-order IR is made by hand; its reference is the left-order spec's
SCALAR = """mixer right_scalar_native
input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1)
S = exp(g) (I - beta k k^T) S + beta k v^T
o = S^T q
"""

CASES = {
    "varlen-T150-H2-HV4-K20-V12-h0": Case(B=1, T=150, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 5, 5, 70, 150),
                                          initial_state=True, seed=21),
    "B2-T37-H1-HV2-K20-V12-h0": Case(B=2, T=37, H=1, HV=2, K=20, V=12, initial_state=True, scale=0.7, seed=22),
    "T1": Case(B=2, T=1, H=1, HV=1, K=16, V=16, initial_state=True, seed=23),
    "T63-K24-V40": Case(B=1, T=63, H=1, HV=1, K=24, V=40, seed=24),
    "T130-HV3": Case(B=1, T=130, H=1, HV=3, K=16, V=16, initial_state=True, seed=25),
}


@pytest.fixture(autouse=True)
def native(monkeypatch):
    """The native forward is opt-in (LRDSL_NATIVE_RANK2=1): slower than the split on the H200 so far."""
    monkeypatch.setenv("LRDSL_NATIVE_RANK2", "1")


def test_the_split_serves_unless_asked(compiled, monkeypatch):
    monkeypatch.delenv("LRDSL_NATIVE_RANK2")
    mixer = _kda_right(compiled)
    native, split = _counted(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=8, initial_state=True, seed=35), DEVICE)
    with torch.no_grad():
        o, _ = mixer.chunk(**x, **opts)
    assert not any(native) and split and rms_ratio(o, reference(mixer, x, opts)[0]) < TOL


def _kda_right(compiled):
    return compiled(next(p for p in EXAMPLES if p.stem == "kda_decay_after_erase"))


def _counted(mixer, monkeypatch):
    """(native launches, split launches) from now on: every native kernel's, the split's state pass."""
    native = [count_launches(monkeypatch, mixer.kernels, n) for n in NATIVE]
    split = count_launches(monkeypatch, mixer.split.kernels, "staged_state") if mixer.split is not None else []
    return native, split


def test_plan_flag_and_kernels(compiled):
    """rank2 for the decay after the erase along the write key; not for a left order, another erase
    direction, or an auxiliary state; only rank2 specs generate the native kernels."""
    flags = {p.stem: plan(rendered_ir(p)).rank2 for p in EXAMPLES}
    assert {n for n, f in flags.items() if f} == {"kda_decay_after_erase"}
    other = lrdsl.compile(text="mixer right_other\ninput q[K] l2norm, k[K] l2norm, a[K] l2norm, v[V], g[K] log, "
                               "beta in (0, 1)\nS = diag(exp(g)) (I - beta a a^T) S + k v^T\no = S^T q\n",
                          load_kernels=False)
    assert other.ir.delta.order == "right" and not plan(other.ir).rank2  # a != u: the split
    assert hasattr(_kda_right(compiled).kernels, "rank2_fwd")
    assert not hasattr(compiled(next(p for p in EXAMPLES if p.stem == "kda")).kernels, "rank2_fwd")


# the richest case and T1 in pytest -q, the others under -m slow
@pytest.mark.parametrize("case_id", [c if c in ("varlen-T150-H2-HV4-K20-V12-h0", "T1") else pytest.param(c, marks=pytest.mark.slow)
                                     for c in CASES])
def test_native_forward_matches_reference(case_id, compiled, monkeypatch):
    mixer = _kda_right(compiled)
    poison = PoisonTorch()
    for module in chunk_modules(mixer):  # every buffer starts as NaN: one the kernels skip shows
        monkeypatch.setattr(module, "torch", poison)
    native, split = _counted(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, CASES[case_id], DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert all(len(n) == 1 for n in native) and not split
    assert poison.poisoned >= 10
    ref_o, ref_s = reference(mixer, x, opts)
    assert not o.isnan().any() and not s.isnan().any()
    e_o, e_s = rms_ratio(o, ref_o), rms_ratio(s, ref_s)
    assert e_o < TOL and e_s < TOL, f"{case_id}: rms ratio o {e_o:.3g}, state {e_s:.3g}"


@pytest.mark.slow  # the opt-in native forward's wider cases (pytest -q's time)
@pytest.mark.parametrize("strength", [-20.0, -5.0, -0.5], ids=["exact-blocks", "mixed", "tensor-cores"])
def test_strong_decays(strength, compiled, monkeypatch):
    """g down to -20 per token and channel: a 16-token block decays past exp(-SPAN) and takes the
    exact path; at -5 some blocks do, at -0.5 none. Every result finite and close."""
    mixer = _kda_right(compiled)
    native, split = _counted(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, Case(B=1, T=140, H=1, HV=2, K=16, V=16, initial_state=True, seed=26), DEVICE)
    x["g"] = (strength * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(27))).to(x["g"].device)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert len(native[0]) == 1 and not split
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


@pytest.mark.slow  # the opt-in native forward's wider cases (pytest -q's time)
def test_a_decay_per_token(monkeypatch):
    """The scalar branch (whole [BT, BT] tiles), on a right-order IR made by hand."""
    left = lrdsl.compile(text=SCALAR, load_kernels=False)
    right = dataclasses.replace(left.ir, delta=dataclasses.replace(left.ir.delta, order="right"))
    assert left.ir.delta.order == "left" and plan(right).rank2 and plan(right).decay_kind == "scalar"
    mixer = Mixer(right)
    native, split = _counted(mixer, monkeypatch)
    case = Case(B=1, T=150, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 37, 150), initial_state=True, seed=28)
    for strength in (None, -20.0):
        x, opts = draw_inputs(mixer, case, DEVICE)
        if strength is not None:
            x["g"] = (strength * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(29))).to(DEVICE)
        with torch.no_grad():
            o, s = mixer.chunk(**x, **opts)
        ref_o, ref_s = reference(left, x, opts)
        assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL
    assert len(native[0]) == 2 and not split


@pytest.mark.slow  # the opt-in native forward's wider cases (pytest -q's time)
@pytest.mark.parametrize("bad", [("k", float("nan"), True), ("v", float("inf"), False), ("g", float("nan"), True)],
                         ids=["k-nan", "v-inf", "g-nan"])
def test_nonfinite_inputs_take_the_split(bad, compiled, monkeypatch):
    """A non-finite input: the host sends the call to the split, whose kernels keep it causal."""
    mixer = compiled(next(p for p in EXAMPLES if p.stem == "kda_decay_after_erase"), check_ranges=False)
    native, split = _counted(mixer, monkeypatch)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=9)
    x, opts = draw_inputs(mixer, case, DEVICE)
    name, value, whole = bad
    check_causal(mixer, spoil(x, name, value, whole, 57), opts, 57, monkeypatch, f"rank2 {name}")
    assert not any(native) and split


@pytest.mark.parametrize("where", [(57, True), (84, False)], ids=["whole-token", "one-channel"])
def test_resets_take_the_native_forward(where, compiled, monkeypatch):
    """-inf in the log-decay (a reset; plan.rank2_resets) is floored as on every path: native."""
    mixer = _kda_right(compiled)
    assert mixer.kernels.RANK2_RESETS == ("g",)
    native, split = _counted(mixer, monkeypatch)
    case = Case(B=1, T=110, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 110), initial_state=True, seed=32)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x = spoil(x, "g", -float("inf"), where[1], where[0])
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert len(native[0]) == 1 and not split
    ref_o, ref_s = reference(mixer, x, opts)
    assert torch.isfinite(o).all() and rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


def test_gradients_keep_the_split(compiled, monkeypatch):
    mixer = _kda_right(compiled)
    native, split = _counted(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=8, initial_state=True, seed=30), DEVICE)
    x["q"].requires_grad_()
    o, _ = mixer.chunk(**x, **opts)
    assert not any(native) and split and o.requires_grad


def test_torch_compile_keeps_the_split(compiled, monkeypatch):
    """Under torch.compile (fullgraph: a graph break raises) the host check cannot run: the split's op."""
    mixer = _kda_right(compiled)
    native, _ = _counted(mixer, monkeypatch)
    x, opts = draw_inputs(mixer, Case(B=1, T=40, H=1, HV=1, K=16, V=8, initial_state=True, seed=31), DEVICE)
    f = torch.compile(lambda t: mixer.chunk(**t, **opts)[0], backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        o = f(x)
    assert not any(native)
    assert rms_ratio(o, reference(mixer, x, opts)[0]) < TOL


VARIANTS = {
    # gdn2's erase read and write value, the decay after the erase; the query unnormalised and scaled
    "gdn2-right": "input q[K], k[K] l2norm, v[V], g[K] log, b[K] in (0, 1), w[V] in (0, 1)\n"
                  "S = diag(exp(g)) (I - k (b*k)^T) S + k (w*v)^T\no = S^T (0.5 * q)\n",
    # a decay given as a gate in (0, 1) per channel, keys of their own per value head, no normalisation
    "gate-decay": "input q[K], k[K] unit, v[V], a[K] in (0, 1), beta in (0, 1)\n"
                  "S = diag(a) (I - beta k k^T) S + beta k v^T\no = S^T q\n",
}


@pytest.mark.slow  # the opt-in native forward's wider cases (pytest -q's time)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_right_order_specs(variant, monkeypatch):
    mixer = lrdsl.compile(text=f"mixer rank2_{variant.replace('-', '_')}\n" + VARIANTS[variant])
    assert plan(mixer.ir).rank2 and mixer.ir.delta.order == "right"
    native, split = _counted(mixer, monkeypatch)
    case = Case(B=1, T=100, H=2, HV=4, K=20, V=12, cu_seqlens=(0, 33, 100), initial_state=True, seed=33)
    x, opts = draw_inputs(mixer, case, DEVICE)
    with torch.no_grad():
        o, s = mixer.chunk(**x, **opts)
    assert len(native[0]) == 1 and not split
    ref_o, ref_s = reference(mixer, x, opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL


def test_fp16_inputs(compiled, monkeypatch):
    """fp16 inputs through the native forward (test_chunk.check_fp16)."""
    mixer = _kda_right(compiled)
    native, _ = _counted(mixer, monkeypatch)
    check_fp16(mixer, Case(B=1, T=70, H=2, HV=2, K=16, V=16, initial_state=True, seed=34))
    assert all(native)
