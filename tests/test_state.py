"""The whole state of mixers with auxiliary states (the ATK preconditioner's P): in and out of
reference, chunk, recurrent and step. Prefilling with chunk and decoding with step must give what
one reference pass over the whole sequence gives, auxiliary states included."""
from __future__ import annotations

import pytest
import torch
from test_recurrent import DEVICE, EXAMPLES, general_kernels

import lrdsl
from lrdsl.testing import TOL, Case, case_tolerance, draw_inputs, rms_ratio

AUX_EXAMPLES = [p for p in EXAMPLES if lrdsl.compile(p, load_kernels=False, check_stability=False).ir.aux]


def one_by_default(paths, stem):
    """pytest params of example paths: `stem` runs in pytest -q, the others under -m slow (CI runs both)."""
    return [pytest.param(p, marks=() if p.stem == stem else pytest.mark.slow) for p in paths]
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


@pytest.mark.parametrize("path", one_by_default(AUX_EXAMPLES, "gdn2_atk"), ids=lambda p: p.stem)
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


@pytest.mark.parametrize("path", one_by_default(AUX_EXAMPLES, "precond_kda"), ids=lambda p: p.stem)
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


def test_chunk_scans_each_auxiliary_state_once(compiled, monkeypatch):
    """The chunked forward gives the auxiliary final states from its own scans: one pass of the
    auxiliary scans per forward, on every path (the custom op from S alone, from a whole state,
    keeping the intermediates: the staged kernels', then the general kernels')."""
    path = next(p for p in AUX_EXAMPLES if p.stem == "precond_deltanet")
    mixer, kept = compiled(path), compiled(path, keep_intermediates=True)
    assert mixer.kernels is kept.kernels
    calls, scan, staged = [], mixer.kernels._aux_states, mixer.kernels._staged_states
    monkeypatch.setattr(mixer.kernels, "_aux_states", lambda *a, **kw: calls.append(1) or scan(*a, **kw))
    monkeypatch.setattr(mixer.kernels, "_staged_states", lambda *a, **kw: calls.append("staged") or staged(*a, **kw))
    case = Case(B=1, T=21, H=1, HV=2, K=16, V=8, cu_seqlens=(0, 6, 6, 21), initial_state=True, seed=4)
    x, opts = draw_inputs(mixer, case, DEVICE)
    whole = mixer.reference(**x, **opts)[1]
    for m, start, general in ((mixer, opts["initial_state"], False), (mixer, whole, False), (kept, whole, False),
                              (kept, whole, True)):
        if general:
            general_kernels(kept, monkeypatch)
        calls.clear()
        with torch.no_grad():
            o, state = m.chunk(**x, **dict(opts, initial_state=start))
        ref_o, ref_state = m.reference(**x, **dict(opts, initial_state=start))
        assert calls.count(1) == 1, f"{calls.count(1)} passes of the auxiliary scans for one forward"
        assert calls.count("staged") == (not general), f"{calls} (general kernels: {general})"
        assert rms_ratio(o, ref_o) < TOL
        _close(state, ref_state, "the final state")


# an offline solve with an auxiliary scan: P enters the regulariser (0.25 + P > 0 as P >= 0); P
# grows without bound where g_p reaches 0, so the condition number has no bound from the ranges
# (the drawn inputs keep it moderate): the spec says it accepts that
MESA_AUX = """mixer mesa_aux
input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1), g_p log, b_p in (0, 1)
state P[K] = exp(g_p) * P + b_p * k * k
S = exp(g) S + (beta*k) v^T
o = S^T (G + diag(0.25 + P))^-1 q
solve offline steps 16
allow ill_conditioned
"""
MESA = EXAMPLES[0].parent / "mesa.lr"
# lets of auxiliary states, made once by the aux pass for the staged kernels: n through another let,
# w of a value-side state (the last one scanned, held in registers there)
STORED_LETS = """mixer stored_lets
input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1), a1 log shared, a2 log
state P1[K] = exp(a1) * P1 + k * k
state P2[V] = exp(a2) * P2 + v * v
let m = squash(P1, x = 1.5, center = -0.2)
let n = m / 2
let w = 1 / (1 + P2)
S = (I - beta (n*k) k^T) exp(g) S + beta (n*k) (w*v)^T
o = S^T q
"""
# (spec, where chunk starts from): "whole" a whole state (every part differentiated), "S" the plain
# S (auxiliary states from zero: the custom op), "kept" a whole state with keep_intermediates (the
# staged kernels, the backward reading what the forward kept), "general" the same on the general
# kernels (general_kernels); the others in -m slow
GRAD_CASES = [("precond_kda", "general"), ("mesa_aux", "whole"), ("stored_lets", "whole")]
SLOW_GRAD_CASES = [("precond_deltanet", "whole"), ("precond_deltanet", "kept"), ("precond_kda", "whole"), ("gdn2_atk", "whole"), ("precond_deltanet", "S"),
                   ("precond_kda", "S"), ("gdn2_atk", "S"), ("precond_deltanet", "general"), ("gdn2_atk", "general"),
                   ("precond_kda", "kept"), ("gdn2_atk", "kept"), ("mesa", "whole"), ("mesa", "S"), ("mesa_aux", "S")]


def test_lets_of_auxiliary_states_are_stored_by_the_aux_pass():
    """The lets the update reads of auxiliary states (n and w; not m, which only n reads) are
    stored, and the staged kernels compute no let of an auxiliary state themselves."""
    from lrdsl.codegen.plan import plan
    p = plan(lrdsl.compile(text=STORED_LETS, load_kernels=False).ir)
    assert p.staged and [(v, kind) for v, kind, _ in p.stored_lets] == [("b_n", "K"), ("b_w", "V")]
    assert p.kernel_lets == ()


def _grad_mixer(name, start, compiled, monkeypatch):
    if name == "stored_lets":
        return lrdsl.compile(text=STORED_LETS)
    if name.startswith("mesa"):
        mixer = compiled(MESA) if name == "mesa" else lrdsl.compile(text=MESA_AUX)
        monkeypatch.setattr(mixer.kernels, "MESA_CHUNK", 16)  # short sequences cross chunks
        return mixer
    mixer = compiled(next(p for p in AUX_EXAMPLES if p.stem == name), keep_intermediates=start in ("kept", "general"))
    return general_kernels(mixer, monkeypatch) if start == "general" else mixer


@pytest.mark.parametrize("name, start", GRAD_CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_GRAD_CASES],
                         ids=lambda v: str(v))
def test_gradients_through_the_whole_state(name, start, compiled, monkeypatch):
    """chunk under autograd (packed sequences, one of them empty, odd T): gradients of every input,
    of S0 and of every other part of the initial state against the float64 reference's autograd,
    for a loss on o and on every part of the final whole state (S, the auxiliary states, G)."""
    mixer = _grad_mixer(name, start, compiled, monkeypatch)
    case = Case(B=1, T=41, H=2, HV=4, K=16, V=12, cu_seqlens=(0, 9, 9, 41), initial_state=True, seed=23)
    x, opts = draw_inputs(mixer, case, DEVICE)
    first = mixer.reference(**x, **opts)[1]  # a whole state reached by the recurrence itself
    gen = torch.Generator().manual_seed(5)
    weights = {n: torch.randn(*t.shape, generator=gen, dtype=torch.float64).to(DEVICE)
               for n, t in [("o", torch.empty(1, 41, 4, 12)), ("S", first.S), *sorted(first.aux.items())]}

    def run(fn, dtype, final_parts):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in x.items()}
        parts = {"S0": first.S, **({n + "0": t for n, t in first.aux.items()} if start != "S" else {})}
        parts = {n: t.detach().to(dtype).requires_grad_() for n, t in parts.items()}
        h0 = parts["S0"] if start == "S" else lrdsl.MixerState(parts["S0"], {n[:-1]: parts[n] for n in parts if n != "S0"})
        o, s = fn(**leaves, initial_state=h0, output_final_state=True, scale=opts["scale"], cu_seqlens=opts["cu_seqlens"])
        assert isinstance(s, lrdsl.MixerState) and sorted(s.aux) == sorted(first.aux)
        finals = {"o": o, "S": s.S, **s.aux}
        sum(((finals[n].double() * weights[n]).sum() for n in final_parts)).backward()
        return {**{n: t.grad for n, t in leaves.items()}, **{n: t.grad for n, t in parts.items()}}

    every = list(weights)
    ref, got = run(mixer.reference, torch.float64, every), run(mixer.chunk, torch.float32, every)
    # the auxiliary final states' share of the gradients is large enough to be seen
    without = run(mixer.reference, torch.float64, ["o", "S"])
    assert max(rms_ratio(without[n], ref[n]) for n in ref) > 0.1, "the test would not see the final aux states' gradient"
    tol = case_tolerance(mixer, case, TOL)  # an offline solve: CG's for the case
    errors = {n: rms_ratio(got[n], ref[n]) for n in ref}
    bad = {n: e for n, e in errors.items() if not e < (tol if n in ("q", "k", "v", "S0") else 10 * tol)}
    assert not bad, errors


@pytest.mark.slow  # the default tier takes torch.compile through the staged path (test_backward.py)
@pytest.mark.parametrize("name", ["mesa_aux", "mesa"])
def test_offline_solve_under_torch_compile(name, compiled, monkeypatch):
    """torch.compile (aot_eager, fullgraph: a graph break raises) of a loss through an offline
    solve's chunk from a whole state: one graph, and the loss and the gradients of every input and
    every part of the initial state equal eager's (which keeps the forward's intermediates, where
    the compiled op recomputes them)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    mixer = _grad_mixer(name, "whole", compiled, monkeypatch)
    # batched, not packed: validating cu_seqlens reads them on the host (a graph break for any spec)
    case = Case(B=2, T=23, H=2, HV=4, K=16, V=12, initial_state=True, seed=29)
    x, opts = draw_inputs(mixer, case, DEVICE)
    first = mixer.reference(**x, **opts)[1]
    gen = torch.Generator().manual_seed(6)
    names = list(x)
    start = {"S": first.S, **first.aux}
    weights = {n: torch.randn(*t.shape, generator=gen).to(DEVICE) for n, t in start.items()}
    do = torch.randn(2, 23, 4, 12, generator=gen).to(DEVICE)

    def f(*leaves):
        xs, parts = dict(zip(names, leaves)), dict(zip(start, leaves[len(names):]))
        h0 = lrdsl.MixerState(parts["S"], {n: parts[n] for n in first.aux})
        o, s = mixer.chunk(**xs, initial_state=h0, output_final_state=True, scale=opts["scale"],
                           cu_seqlens=opts["cu_seqlens"])
        finals = {"S": s.S, **s.aux}
        return (o * do).sum() + sum((finals[n] * weights[n]).sum() for n in start)

    def run(fn):
        leaves = [x[n].float().detach().requires_grad_() for n in names] + \
                 [t.float().detach().requires_grad_() for t in start.values()]
        loss = fn(*leaves)
        return loss.detach(), torch.autograd.grad(loss, leaves)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    loss_c, grads_c = run(torch.compile(f, backend=counter, fullgraph=True))
    loss_e, grads_e = run(f)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"
    assert abs(loss_c.item() - loss_e.item()) <= 1e-5 * abs(loss_e.item()) + 1e-5
    for n, gc, ge in zip(names + list(start), grads_c, grads_e):
        assert gc is not None and gc.shape == ge.shape, n
        assert rms_ratio(gc, ge) < 1e-5, f"d{n}: compiled vs eager {rms_ratio(gc, ge):.3g}"


def test_chunked_aux_pass_with_resets_and_a_whole_initial_state(compiled):
    """The aux pass's chunked form (codegen/plan.py's aux_chunked: a decay of one number per head
    and token), over several chunks of packed sequences from a whole state:
    g_atk at -inf (a reset) at a chunk's first row, mid-chunk and at a sequence's last token, -1e4
    at another token. Outputs and final whole states against the float64 reference."""
    mixer = compiled(next(p for p in AUX_EXAMPLES if p.stem == "gdn2_atk"))
    assert mixer.kernels.AUX_CHUNKED == (True,)
    case = Case(B=1, T=230, H=2, HV=2, K=16, V=12, cu_seqlens=(0, 90, 90, 230), initial_state=True, seed=23)
    x, opts = draw_inputs(mixer, case, DEVICE)
    first = mixer.reference(**x, **opts)[1]  # a whole state reached by the recurrence itself
    for t, value in ((30, float("-inf")), (89, float("-inf")), (90 + 64, float("-inf")), (90 + 100, -1e4)):
        x["g_atk"][0, t] = value
    opts = dict(opts, initial_state=first)
    ref_o, ref_state = mixer.reference(**{n: t.double() for n, t in x.items()},
                                       **dict(opts, initial_state=lrdsl.MixerState(
                                           first.S.double(), {n: a.double() for n, a in first.aux.items()})))
    with torch.no_grad():
        o, state = mixer.chunk(**x, **opts)
    assert rms_ratio(o, ref_o) < TOL, rms_ratio(o, ref_o)
    _close(state, ref_state, "chunked aux pass")
