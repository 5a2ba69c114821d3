"""Segmented chunk passes on one device (mixer.chunk(..., segments=n), lrdsl/runtime/segments.py) on
CPU, kernels in Triton's interpreter.

The sequences are cut into segments of 64-token multiples that run as one chunk call; their maps of
the incoming state are composed and the outputs finished in torch. Each case runs the segmented call,
the one-pass call (segments=1) and the float64 reference on the same inputs (test_cp's: weak decays,
so that a segment's map does not vanish, and a whole initial state, auxiliary states included), and
compares o, every part of the final state and the gradients of
loss = (o * do).sum() + sum over the parts of the final state of (part * weight).sum()
with respect to every input, param and part of the initial state: rms ratio < 1e-4 for o, the state
and dq, dk, dv, dh0, < 1e-3 for the other inputs (test_backward's tolerances). It also counts the
chunk calls the segmented pass makes (one wide call; the auxiliary maps' call; the fallback's two),
so a call that silently kept one pass fails.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch
from test_cp import ROOT, SPECS, TOL_GATE, inputs, whole
from test_two_sided import spec_text

import lrdsl
from lrdsl.errors import InputError
from lrdsl.runtime import segments as seg
from lrdsl.runtime.affine import widens
from lrdsl.testing import TOL, Case, rms_ratio

# (case, segments asked for): the segment length is the longest sequence / segments, up to 64s
CASES = {
    # a sequence shorter than a segment, one of three segments (the last short), an empty one, one of two
    "packed": (Case(B=1, T=230, H=1, HV=2, K=16, V=16, cu_seqlens=(0, 20, 160, 160, 230),
                    initial_state=True, seed=21), 4),
    # T a multiple of the segment length: the segments are a batch [B * 3, 64]
    "batched": (Case(B=2, T=192, H=1, HV=2, K=16, V=16, initial_state=True, seed=22), 3),
    # T not a multiple: packed segments 64, 64, 22 per sequence; two value heads per key head; K > V
    # (the fallback's identity columns in two blocks)
    "batched-ragged": (Case(B=2, T=150, H=1, HV=2, K=32, V=16, initial_state=True, seed=23), 3),
}
# the left-side examples of test_cp, and a value-side transition (S N: its maps act from the right)
SPECS = {**SPECS, "oja": ROOT / "examples" / "oja.lr"}
FAMILIES = ("gated_deltanet", "kda", "gla", "deltanet", "gdn2_atk", "precond_kda", "rwkv7", "rwkv6", "delta_product2", "oja",
            "cp_fallback_test_only")
DEFAULT = ("gated_deltanet", "packed")


def validated(mixer, x, cu):
    """The Batch a chunk call over x makes."""
    t = dict(x)
    return mixer._validate(t.pop("q"), t.pop("k"), t.pop("v"), t, None, None, False, cu)


def check(name, case_name, compiled, monkeypatch):
    case, n = CASES[case_name]
    mixer = compiled(SPECS[name])
    x, h0, cu = inputs(mixer, case)
    one = whole(functools.partial(mixer.chunk, segments=1), mixer, case, x, h0, cu, torch.float32)
    ref = whole(mixer.reference, mixer, case, x, h0, cu, torch.float64)
    calls, plain = [], mixer.chunk

    def counted(*a, **kw):  # the calls the segmented pass makes: [batch, T, value columns]
        if kw.get("segments") == 1:
            calls.append([*kw["v"].shape[:2], kw["v"].shape[-1]])
        return plain(*a, **kw)
    monkeypatch.setattr(mixer, "chunk", counted)
    cut = seg.plan(mixer, validated(mixer, x, cu), n, None)
    got = whole(functools.partial(mixer.chunk, segments=n), mixer, case, x, h0, cu, torch.float32)
    check_calls(mixer, case, cut, calls)
    errors = {}
    for what, (o_b, fin_b, g_b) in (("one pass", one), ("reference", ref)):
        errors[what, "o"] = rms_ratio(got[0], o_b)
        errors.update({(what, p): rms_ratio(t, fin_b[p]) for p, t in got[1].items()})
        errors.update({(what, "d" + p): rms_ratio(t, g_b[p]) for p, t in got[2].items()})
    tol = {k: (TOL if k[1] == "o" or k[1] in got[1] or k[1] in ("dq", "dk", "dv") or k[1].startswith("dh0")
               else TOL_GATE) for k in errors}
    bad = {k: f"{e:.3g}" for k, e in errors.items() if not e < tol[k]}
    assert not bad, f"{name} {case_name}: {bad}"


def check_calls(mixer, case, cut, calls):
    """The segmented forward's chunk calls: the auxiliary maps' call (two copies of the segments,
    one value channel), then one wide call (V + K value columns), or the fallback's batched starts
    (1 + ceil(K/V) copies) and the rerun."""
    assert cut is not None and len(cut.bounds) > case.N, f"no segments cut: {cut}"
    n, tokens = len(cut.bounds), case.B * case.T

    def rows(c):  # [batch, T] of c copies of the segments
        return [c * n, cut.uniform] if cut.uniform else [1, c * tokens]
    want = []
    if mixer.ir.aux:
        want.append(rows(2) + [1])
    if widens(mixer.ir):
        want.append(rows(1) + [case.V + case.K])
    else:  # a value-side transition's maps from blocks of K identity rows, the others' of V columns
        blocks = -(-case.V // case.K) if mixer.ir.side == "right" else -(-case.K // case.V)
        want += [rows(1 + blocks) + [case.V], rows(1) + [case.V]]
    assert calls == want, f"chunk calls {calls}, expected {want}"


# every family once and every layout thrice under -m slow (the families' cases rotate over the layouts;
# the whole matrix, 27 cases, took 13 minutes on two cores): LRDSL_SEGMENTS_ALL=1 runs all of it
_ALL = bool(os.environ.get("LRDSL_SEGMENTS_ALL"))
PARAMS = [pytest.param(f, c, marks=() if (f, c) == DEFAULT else pytest.mark.slow)
          for i, f in enumerate(FAMILIES) for j, c in enumerate(CASES)
          if _ALL or (f, c) == DEFAULT or j == (i + 1) % len(CASES)]


@pytest.mark.parametrize("name,case_name", PARAMS)
def test_segments_match_one_pass_and_reference(name, case_name, compiled, monkeypatch):
    check(name, case_name, compiled, monkeypatch)


def test_cut_of_packed_sequences():
    c = seg.cut([0, 40, 200, 200, 300], 64)
    assert c.bounds == ((0, 40), (40, 104), (104, 168), (168, 200), (200, 200), (200, 264), (264, 300))
    assert c.through == (False, False, True, True, False, False, True)
    assert c.lasts == (0, 3, 4, 6)
    assert c.uniform == 0
    assert seg.cut([0, 128, 256], 64).uniform == 64


def test_count_segments_only_an_idle_gpu():
    # B x HV x value tiles against 132 SMs (an H100): what the H100 measured best (segments.count)
    assert seg.count(1, 4, 2, 65536, 132) == 8
    assert seg.count(1, 2, 2, 65536, 132) == 16
    assert seg.count(1, 8, 2, 65536, 132) == 1  # H=8 over two key heads: one pass was faster
    assert seg.count(4, 16, 2, 4096, 132) == 1  # the standard shapes keep one pass
    assert seg.count(1, 32, 2, 16384, 132) == 1
    assert seg.count(1, 4, 2, 3000, 132) == 2  # no segment shorter than MIN_LENGTH
    assert seg.count(1, 4, 2, 1500, 132) == 1
    assert seg.count(1, 4, 2, 65536, 0) == 1


def test_segments_asked_for_and_refused(compiled, monkeypatch):
    mixer = compiled(SPECS["gated_deltanet"])
    case = Case(B=1, T=130, H=1, HV=1, K=16, V=16)
    x, h0, cu = inputs(mixer, case)
    batch = validated(mixer, x, None)
    assert seg.plan(mixer, batch, None, None) is None  # the CPU: one pass unless asked
    assert seg.plan(mixer, batch, 1, None) is None
    assert len(seg.plan(mixer, batch, 2, None).bounds) == 2
    assert seg.plan(mixer, batch, 3, None).bounds == ((0, 64), (64, 128), (128, 130))
    monkeypatch.setenv("LRDSL_SEGMENTS", "2")
    assert len(seg.plan(mixer, batch, None, None).bounds) == 2
    assert seg.plan(mixer, batch, 1, None) is None  # the argument first
    for bad, where in (("two", "LRDSL_SEGMENTS"), ("0", "LRDSL_SEGMENTS")):
        monkeypatch.setenv("LRDSL_SEGMENTS", bad)
        with pytest.raises(InputError, match=f"^{where} must be a positive integer"):
            mixer.chunk(**x)
    monkeypatch.delenv("LRDSL_SEGMENTS")
    for bad in (0, 2.5, True):
        with pytest.raises(InputError, match="^segments must be a positive integer"):
            mixer.chunk(**x, segments=bad)
    mesa = compiled(ROOT / "examples" / "mesa.lr")  # the offline solve keeps one pass
    xm, _, _ = inputs(mesa, case)
    assert seg.plan(mesa, validated(mesa, xm, None), 2, None) is None
    # and a two-sided transition (M S N: its map of the state is no matrix product)
    both = lrdsl.compile(text=spec_text("kda_oja"))
    xb, _, _ = inputs(both, case)
    assert seg.plan(both, validated(both, xb, None), 2, None) is None


def test_a_nan_stays_in_its_sequence(compiled):
    """A nan in one packed sequence leaves the others as one pass gives them (the scan selects where
    a sequence starts, it does not multiply by a zero map)."""
    mixer = compiled(SPECS["gated_deltanet"])
    case, n = CASES["packed"]
    x, h0, cu = inputs(mixer, case)
    x["v"][0, 50, 0, 3] = float("nan")  # in the second sequence's first segment
    o1, s1 = mixer.chunk(**x, initial_state=h0, cu_seqlens=cu, output_final_state=True, segments=1)
    o2, s2 = mixer.chunk(**x, initial_state=h0, cu_seqlens=cu, output_final_state=True, segments=n)
    for a, b in ((0, 40), (200, 300)):  # the first and the last sequence
        assert o2[:, a:b].isfinite().all() and rms_ratio(o2[:, a:b], o1[:, a:b]) < TOL
    for i in (0, 2, 3):
        assert s2[i].isfinite().all() and rms_ratio(s2[i], s1[i]) < TOL
    assert o2[:, 40:200].isnan().any() == o1[:, 40:200].isnan().any()


@pytest.mark.parametrize("name", ["gated_deltanet", "delta_product2", "rwkv6", "oja"])
def test_the_schedule_cuts_only_where_the_maps_ride_in_one_run(name, compiled, monkeypatch):
    """The schedule's own choice (a GPU of 132 SMs, here stood in for): a long sequence with one head
    is cut where the maps ride in the wide run, and left whole where they take the fallback's two
    more runs (rwkv6's bonus term; oja's value-side transition)."""
    import dataclasses
    from types import SimpleNamespace
    mixer = compiled(SPECS.get(name, ROOT / "examples" / f"{name}.lr"))
    x, _, _ = inputs(mixer, Case(B=1, T=64, H=1, HV=1, K=16, V=16, seed=35))
    batch = validated(mixer, x, None)
    on_gpu = SimpleNamespace(device=SimpleNamespace(type="cuda", index=0))
    batch = dataclasses.replace(batch, T=16384, tensors={**batch.tensors, "q": on_gpu})
    monkeypatch.setattr(seg, "sm_count", lambda index: 132)
    cut = seg.plan(mixer, batch, None, None)
    assert (cut is not None) == (name in ("gated_deltanet", "delta_product2")), cut
    assert cut is None or len(cut.bounds) == seg.count(1, 1, 1, 16384, 132)


@pytest.mark.parametrize("n,HV", [(3, 2), pytest.param(2, 5, marks=pytest.mark.slow)])  # a loop over the heads; over the pieces
def test_finish_reads_the_wide_output_in_place(n, HV):
    """affine.finish in bf16 (the GEMMs on strided views, affine._Finish) against its float64
    arithmetic, o_w[..., :V] + C S, forward and both gradients; and _Finish itself through
    gradcheck in float64, a second derivative included (its backward's einsum)."""
    from lrdsl.runtime.affine import _Finish, finish
    t, K, V = 37, 24, 16
    g = torch.Generator().manual_seed(n * 10 + HV)
    o_w = torch.randn(n, t, HV, V + K, generator=g, dtype=torch.float64)
    S = torch.randn(n, HV, K, V, generator=g, dtype=torch.float64)
    do = torch.randn(n, t, HV, V, generator=g, dtype=torch.float64)
    ref_w, ref_S = o_w.clone().requires_grad_(), S.clone().requires_grad_()
    ref = ref_w[..., :V] + torch.einsum("bthk,bhkv->bthv", ref_w[..., V:], ref_S)
    ref.backward(do)
    w16, S32 = o_w.bfloat16().requires_grad_(), S.float().requires_grad_()
    o = finish(w16, V, S32)
    o.backward(do.bfloat16())
    assert o.dtype == torch.bfloat16 and o.shape == (n, t, HV, V) and o.is_contiguous()
    assert rms_ratio(o.double(), ref) < 1e-2
    assert w16.grad.dtype == torch.bfloat16 and rms_ratio(w16.grad.double(), ref_w.grad) < 1e-2
    assert S32.grad.dtype == torch.float32 and rms_ratio(S32.grad.double(), ref_S.grad) < 1e-2
    # two pieces of at most three heads: the same loop as the case's (pieces where HV > 2), and a
    # second derivative over a third of the entries (gradgradcheck's time grows as their square)
    args = (o_w[:2, :5, :3].clone().requires_grad_(), V, S[:2, :3].clone().requires_grad_())
    assert torch.autograd.gradcheck(_Finish.apply, args)
    assert torch.autograd.gradgradcheck(_Finish.apply, args)


@pytest.mark.parametrize("kind", ["left", "right", "elementwise"])
def test_incoming_states_compose_each_run_and_stop_at_its_start(kind):
    """affine.incoming against its definition, piece by piece: S_in[j] = S_out[j-1] inside a run
    and zero where a run starts; S_out[j] = R_j + L_j S_in[j] (S_in[j] L_j for value-side maps,
    L_j * S_in[j] for auxiliary states); a nan in one run stays out of the next."""
    from lrdsl.runtime.affine import incoming, right_mul
    mul = {"left": torch.matmul, "right": right_mul, "elementwise": torch.mul}[kind]
    g = torch.Generator().manual_seed(len(kind))
    n, HV, K = 7, 2, 5
    shape = (n, HV, K) if kind == "elementwise" else (n, HV, K, K)
    L, R = torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)
    starts = (True, False, False, True, False, True, False)
    R[2, 0].fill_(float("nan"))  # in the first run only
    S_in, S_out = incoming(L, R, mul, starts)
    prev = None
    for j in range(n):
        want_in = torch.zeros_like(R[j]) if starts[j] else prev
        want_out = R[j] if starts[j] else R[j] + mul(L[j], want_in)
        torch.testing.assert_close(S_in[j], want_in, equal_nan=True)
        torch.testing.assert_close(S_out[j], want_out, equal_nan=True)
        prev = want_out
    assert S_out[:3].isnan().any() and S_out[3:].isfinite().all() and S_in[3:].isfinite().all()
