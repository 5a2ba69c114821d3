"""The whole state of mixers with auxiliary states (the ATK preconditioner's P): in and out of
reference, chunk, recurrent and step. Prefilling with chunk and decoding with step must give what
one reference pass over the whole sequence gives, auxiliary states included."""
from __future__ import annotations

import pytest
import torch

import lrdsl
from lrdsl.fuzz import TOL, Case, draw_inputs, rms_ratio

from test_backward import TOL_GATE, TOL_QKV
from test_recurrent import DEVICE, EXAMPLES

AUX_EXAMPLES = [p for p in EXAMPLES if lrdsl.compile(p, load_kernels=False).ir.aux]
CASE = Case(B=2, T=40, H=2, HV=4, K=16, V=12, initial_state=True, seed=21)
SPLIT = 25  # prefill these tokens, decode the rest


def _part(x, lo, hi):
    return {n: t[:, lo:hi].contiguous() for n, t in x.items()}


def _close(got, want, what):
    assert isinstance(got, lrdsl.MixerState), f"{what}: {type(got).__name__}"
    assert sorted(got.aux) == sorted(want.aux), what
    errors = {"S": rms_ratio(got.S, want.S), **{n: rms_ratio(got.aux[n], want.aux[n]) for n in want.aux}}
    assert all(e < TOL for e in errors.values()), f"{what}: {errors}"


def test_there_are_examples_with_auxiliary_states():
    assert {p.stem for p in AUX_EXAMPLES} >= {"precond_deltanet", "precond_kda", "gdn2_atk"}


@pytest.mark.parametrize("path", AUX_EXAMPLES, ids=lambda p: p.stem)
def test_prefill_then_decode_equals_one_reference_pass(path, compiled):
    mixer = compiled(path)
    x, opts = draw_inputs(mixer, CASE, DEVICE)
    h0 = opts["initial_state"]
    whole = dict(scale=0.5, initial_state=h0, output_final_state=True)
    ref_o, ref_state = mixer.reference(**x, **whole)
    with torch.no_grad():
        o1, state = mixer.chunk(**_part(x, 0, SPLIT), **whole)
        _close(state, mixer.reference(**_part(x, 0, SPLIT), **whole)[1], "chunk's final state")
        state = lrdsl.MixerState(state.S.contiguous(), {n: t.contiguous() for n, t in state.aux.items()})
        s_ptr = state.S.data_ptr()
        outs = [o1]
        for lo, hi in ((SPLIT, SPLIT + 1), (SPLIT + 1, SPLIT + 6), (SPLIT + 6, CASE.T)):  # 1, 5, 9 tokens
            outs.append(mixer.step(**_part(x, lo, hi), state=state, scale=0.5))
    assert state.S.data_ptr() == s_ptr  # updated in place
    e_o = rms_ratio(torch.cat(outs, 1), ref_o)
    assert e_o < TOL, f"prefill + decode against one pass: rms ratio {e_o:.3g}"
    _close(state, ref_state, "state after decoding")


@pytest.mark.parametrize("path", AUX_EXAMPLES, ids=lambda p: p.stem)
def test_every_path_continues_from_a_whole_state(path, compiled):
    """The second half from the first half's whole state (packed sequences, grouped value heads):
    chunk and recurrent against the reference, outputs and final whole states."""
    mixer = compiled(path)
    case = Case(B=1, T=40, H=2, HV=4, K=16, V=12, cu_seqlens=(0, 9, 9, 40), initial_state=True, seed=22)
    x, opts = draw_inputs(mixer, case, DEVICE)
    first = mixer.reference(**x, **opts)[1]  # a whole state reached by the recurrence itself
    opts = dict(opts, initial_state=first)
    ref_o, ref_state = mixer.reference(**x, **opts)
    name = mixer.ir.aux[0].name
    with torch.no_grad():
        for impl in ("chunk", "recurrent"):
            o, state = getattr(mixer, impl)(**x, **opts)
            assert rms_ratio(o, ref_o) < TOL, impl
            _close(state, ref_state, impl)
            # the empty second sequence hands its initial state through unchanged
            assert torch.allclose(state.aux[name][1].float(), first.aux[name][1].float()), impl


def test_zero_state_and_clear_errors(compiled):
    pre = compiled(next(p for p in EXAMPLES if p.stem == "precond_deltanet"))
    plain = compiled(next(p for p in EXAMPLES if p.stem == "gated_deltanet"))
    x, _ = draw_inputs(pre, Case(B=1, T=3, H=1, HV=1, K=8, V=8, seed=3), DEVICE)
    zero = pre.zero_state(1, 1, 8, 8, device=DEVICE)
    assert isinstance(zero, lrdsl.MixerState) and list(zero.aux) == [a.name for a in pre.ir.aux]
    assert isinstance(plain.zero_state(1, 1, 8, 8), torch.Tensor)
    with torch.no_grad():
        with pytest.raises(lrdsl.InputError, match="auxiliary states"):
            pre.step(**x, state=zero.S)  # decoding would silently restart P at zero
        with pytest.raises(lrdsl.InputError, match="must map each auxiliary state"):
            pre.chunk(**x, initial_state=lrdsl.MixerState(zero.S, {}))
        with pytest.raises(lrdsl.InputError, match=r"\[N, HV, K\]"):
            pre.reference(**x, initial_state=lrdsl.MixerState(zero.S, {n: t[:, :, :4] for n, t in zero.aux.items()}))
        xg, _ = draw_inputs(plain, Case(B=1, T=3, H=1, HV=1, K=8, V=8, seed=3), DEVICE)
        with pytest.raises(lrdsl.InputError, match="no auxiliary states"):
            plain.chunk(**xg, initial_state=lrdsl.MixerState(zero.S, zero.aux))
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    # from zero auxiliary states, training works as before and the final state is whole
    o, state = pre.chunk(**leaves, initial_state=zero.S, output_final_state=True)
    o.sum().backward()
    assert isinstance(state, lrdsl.MixerState) and all(t.grad is not None for t in leaves.values())


@pytest.mark.parametrize("path", AUX_EXAMPLES, ids=lambda p: p.stem)
def test_gradients_through_a_whole_initial_state(path, compiled):
    """chunk from a whole initial state under autograd (packed sequences, one of them empty):
    gradients of every input, of S0 and of every auxiliary initial state against the float64
    reference's autograd; the final whole state too (its auxiliary parts carry no gradient)."""
    mixer = compiled(path)
    case = Case(B=1, T=40, H=2, HV=4, K=16, V=12, cu_seqlens=(0, 9, 9, 40), initial_state=True, seed=23)
    x, opts = draw_inputs(mixer, case, DEVICE)
    start = mixer.reference(**x, **opts)[1]  # a whole state reached by the recurrence itself
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, 40, 4, 12, generator=gen).to(DEVICE)
    dS = torch.randn(3, 4, 16, 12, generator=gen).to(DEVICE)

    def run(fn, dtype):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in x.items()}
        S0 = start.S.detach().to(dtype).requires_grad_()
        aux0 = {n: t.detach().to(dtype).requires_grad_() for n, t in start.aux.items()}
        o, s = fn(**leaves, initial_state=lrdsl.MixerState(S0, aux0), output_final_state=True,
                  scale=opts["scale"], cu_seqlens=opts["cu_seqlens"])
        assert isinstance(s, lrdsl.MixerState)
        ((o.double() * do.double()).sum() + (s.S.double() * dS.double()).sum()).backward()
        return {**{n: t.grad for n, t in leaves.items()}, "S0": S0.grad, **{"aux0 " + n: t.grad for n, t in aux0.items()}}

    ref, got = run(mixer.reference, torch.float64), run(mixer.chunk, torch.float32)
    errors = {n: rms_ratio(got[n], ref[n]) for n in ref}
    assert all(ref[n].abs().sum() > 0 for n in ref if n.startswith("aux0")), "the test would not see the aux gradient"
    bad = {n: e for n, e in errors.items() if not e < (TOL_QKV if n in ("q", "k", "v", "S0") else TOL_GATE)}
    assert not bad, errors
