"""The chunked backward against float64 autograd through the reference scan.

For each case the same fp32 inputs (drawn inside the ranges the spec declares by lrdsl.fuzz) go
through `mixer.chunk`, and float64 copies through `mixer.reference`; both are differentiated for

    loss = (o * do).sum() + (S * dS).sum()        (random do and dS; the dS term when S is returned,
                                                   and a term like it for each auxiliary final state)

with respect to q, k, v, every other input of the spec and the initial state. Tolerances, as
rms(chunk - reference) / rms(reference):

    < 1e-4  for dq, dk, dv and dh0;      < 1e-3  for the gradients of the other (gate) inputs.

Also here: keep_intermediates=True gives the recompute path's gradients (the staged backward
reading what the staged forward kept, and the general kernels); torch.compile
(aot_eager, fullgraph) of a loss through mixer.chunk; mixer.recurrent is forward-only.
(gradcheck of the reference itself lives in tests/test_reference.py.)
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from specgen import axis_specs, default_first, example_params, kernel_examples, rendered_ir
from test_recurrent import general_kernels

import lrdsl
from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = kernel_examples()  # every example but the offline solve (reference only)
DEVICE = "cuda" if os.environ.get("LRDSL_TEST_DEVICE") == "cuda" else "cpu"
TOL_QKV = 1e-4  # dq, dk, dv, dh0
TOL_GATE = 1e-3  # every other input


# ---- helpers ---------------------------------------------------------------------------------
def rms(t):
    return t.detach().to("cpu", torch.float64).pow(2).mean().sqrt().item() if t.numel() else 0.0


def upstream(o_shape, s_shape, seed):
    """Random upstream gradients for o and the final state (never zero), from their own seed."""
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(o_shape, generator=g)
    dS = torch.randn(s_shape, generator=g) if s_shape is not None else None
    return do, dS


def gradients(fn, x, h0, opts, do, dS, dtype):
    """(o, S, {name: grad}) of (o*do).sum() + (S*dS).sum() through fn, for every input and h0."""
    leaves = {n: t.detach().to(DEVICE if dtype == torch.float32 else "cpu", dtype).requires_grad_()
              for n, t in x.items()}
    if h0 is not None:
        leaves["initial_state"] = h0.detach().to(DEVICE if dtype == torch.float32 else "cpu",
                                                 dtype).requires_grad_()
    dev = next(iter(leaves.values())).device
    o, S = fn(**leaves, **opts)
    loss = (o * do.to(dev, dtype)).sum()
    if isinstance(S, lrdsl.MixerState):  # the whole state: each auxiliary part with weights of its own
        gen = torch.Generator().manual_seed(len(S.aux))
        for _, a in sorted(S.aux.items()):
            loss = loss + (a * torch.randn(a.shape, generator=gen, dtype=torch.float64).to(dev, dtype)).sum()
        S = S.S
    if dS is not None:
        assert S is not None, "output_final_state=True but no final state came back"
        loss = loss + (S * dS.to(dev, dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))  # raises if an input is unused
    return o, S, dict(zip(leaves, grads))


def count_launches(monkeypatch, module, kernel: str) -> list:
    """The grids of every launch of a generated module's tuned kernel from now on (for the test)."""
    launches, original = [], getattr(module, kernel)

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return original[grid]

    monkeypatch.setattr(module, kernel, Counting())
    return launches


def tolerance(name):
    return TOL_QKV if name in ("q", "k", "v", "initial_state") else TOL_GATE


def compare(mixer, case: Case, output_final_state=True, seed=0, edit=None):
    """Chunk (fp32) vs float64 reference gradients for a case: (errors {name: ratio}, failures).
    edit(x) may change the drawn inputs in place first."""
    x, opts = draw_inputs(mixer, case, "cpu")
    if edit is not None:
        edit(x)
    h0 = opts.pop("initial_state")
    opts["output_final_state"] = output_final_state
    o_shape = (case.B, case.T, case.HV, case.V)
    s_shape = (case.N, case.HV, case.K, case.V) if output_final_state else None
    do, dS = upstream(o_shape, s_shape, seed)
    ref_o, ref_S, ref = gradients(mixer.reference, x, h0, dict(opts), do, dS, torch.float64)
    dev_opts = dict(opts, cu_seqlens=None if opts["cu_seqlens"] is None else opts["cu_seqlens"].to(DEVICE))
    o, S, got = gradients(mixer.chunk, x, h0, dev_opts, do, dS, torch.float32)
    errors = {"o": rms_ratio(o, ref_o)}
    if output_final_state:
        errors["S"] = rms_ratio(S, ref_S)
    else:
        assert S is None
    # A gradient that is exactly zero in float64 (e.g. the decay of the first token when it only
    # multiplies a zero state) cannot be compared relatively: the kernel's rounding noise (~1e-8)
    # there is measured against the largest rms of dq, dk, dv instead.
    scale = max(rms(ref[n]) for n in ("q", "k", "v"))
    for name, g in ref.items():
        assert got[name].shape == g.shape and got[name].dtype == torch.float32, name
        if rms(g) == 0.0 and scale > 0.0:
            errors["d" + name] = rms(got[name]) / scale
        else:
            errors["d" + name] = rms_ratio(got[name], g)
    failures = {n: e for n, e in errors.items()
                if not e < (TOL_QKV if n in ("o", "S") else tolerance(n[1:]))}  # nan fails
    return errors, failures


def describe(errors):
    return ", ".join(f"{n} {e:.2g}" for n, e in errors.items())


def repro(load: str, case: Case, output_final_state: bool, seed: int) -> str:
    """A shell command that reruns one comparison and prints every error ratio."""
    code = (f"import sys; sys.path[:0] = ['tests']; import conftest, lrdsl, test_backward as t; "
            f"from lrdsl.testing import Case; m = {load}; "
            f"print(t.compare(m, {case!r}, {output_final_state}, {seed}))")
    return f"cd {ROOT} && .venv/bin/python -c {code!r}"


# ---- every example on odd shapes -------------------------------------------------------------
# T = 37 (not a multiple of 16 or 64), K = 20 and V = 12 (not powers of two, V < 16), HV = 2H,
# an initial state and a non-default scale; two key heads with two value heads each in the first
# case (grouped value heads and shared inputs summed back per key head), sequences of 5, 25, 1 and
# 9 tokens packed with cu_seqlens in the second, of 5, 25 and 1 in the third (the one pytest -q
# runs: each sequence is a program of every kernel, and the 9-token one added no new edge).
# (Batches of 2 are drawn by the random test below.)
CASES = {
    "T37-H2-HV4-K20-V12": Case(B=1, T=37, H=2, HV=4, K=20, V=12, initial_state=True, scale=0.7, seed=11),
    "varlen-5,25,1,9-H1-HV2-K20-V12": Case(B=1, T=40, H=1, HV=2, K=20, V=12, cu_seqlens=(0, 5, 30, 31, 40),
                                            initial_state=True, seed=12),
    "varlen-5,25,1-H1-HV2-K20-V12": Case(B=1, T=31, H=1, HV=2, K=20, V=12, cu_seqlens=(0, 5, 30, 31),
                                          initial_state=True, seed=13),
}
DEFAULT_CASE = "varlen-5,25,1-H1-HV2-K20-V12"


@pytest.mark.parametrize("case_id", default_first(list(CASES), DEFAULT_CASE))
@pytest.mark.parametrize("spec", example_params(EXAMPLES))
def test_example_chunk_gradients_match_reference(spec, case_id, compiled):
    mixer = compiled(spec)
    errors, failures = compare(mixer, CASES[case_id], output_final_state=True, seed=101)
    assert not failures, (f"{spec.stem} {case_id}: failing {describe(failures)}\nall: {describe(errors)}\n"
                          f"reproduce: {repro(f'lrdsl.compile({str(spec)!r})', CASES[case_id], True, 101)}")
    names = {"d" + n for n in mixer.inputs} | {"dinitial_state"}
    assert names <= set(errors), f"gradients not compared: {names - set(errors)}"


# ---- random specs ----------------------------------------------------------------------------
EXPLICIT_DECAYS = {"none": ("", ""), "constant": ("", "0.9 "), "scalar": ("g log", "exp(g) "),
                   "diagonal": ("g[K] log", "diag(exp(g)) ")}
EXPLICIT_ERASES = {  # inputs, erase term a c^T, write term
    "none": ([], "", "k v^T"),
    "beta (0, 1)": (["beta in (0, 1)"], "beta k k^T", "beta k v^T"),
    "beta (0, 2)": (["beta in (0, 2)"], "beta k k^T", "beta k v^T"),
    "channelwise": (["b[K] in [0, 1]", "w[V] in [0, 1]"], "k (b*k)^T", "k (w*v)^T"),
    "atk": (["beta in (0, 1)", "g_atk log shared", "beta_atk in (0, 1) shared"], "beta (m*k) k^T",
            "beta (m*k) v^T"),
}


@st.composite
def explicit_specs(draw):
    """Explicit form, both orders of decay and erase: (I - a c^T) D S + write, and the
    decay-after-erase order D (I - a c^T) S + write (e.g. S = diag(exp(g)) (I - beta k k^T) S + ...)."""
    decay = draw(st.sampled_from(sorted(EXPLICIT_DECAYS)))
    erase = draw(st.sampled_from(sorted(EXPLICIT_ERASES)))
    after = draw(st.booleans())
    d_input, d_text = EXPLICIT_DECAYS[decay]
    e_inputs, e_text, write = EXPLICIT_ERASES[erase]
    norm = " l2norm" if (e_text or draw(st.booleans())) else ""
    lines = ["mixer explicit", f"input q[K]{norm}, k[K]{norm}, v[V]"]
    inputs = ([d_input] if d_input else []) + e_inputs
    if inputs:
        lines.append("input " + ", ".join(inputs))
    if erase == "atk":
        lines += ["state P[K] = exp(g_atk) * P + beta_atk * k * k",
                  "let m = squash(P, x = 1.5, center = -0.2)"]
    if e_text:
        transition = d_text + f"(I - {e_text}) " if after else f"(I - {e_text}) " + d_text
    else:
        transition = d_text
    lines += [f"S = {transition}S + {write}", "o = S^T q"]
    return "\n".join(lines) + "\n"


@st.composite
def grad_cases(draw):
    """T 1-70, K and V in 16-24 (non powers of two included), H 1-2, HV = H or 2H, packed
    sequences (empty ones included) on or off, initial state on or off, the final state returned
    or not. At most 4 (sequence, value head) pairs so that one case stays a few seconds."""
    varlen = draw(st.booleans())
    T = draw(st.integers(1, 70))
    H = draw(st.integers(1, 2))
    HV = H * draw(st.sampled_from((1, 2)))
    B = 1 if (varlen or HV == 4) else draw(st.integers(1, 2))
    cu = None
    if varlen:
        cuts = draw(st.lists(st.integers(0, T), max_size=2 if HV < 4 else 1))
        cu = (0, *sorted(cuts), T)
    size = st.one_of(st.sampled_from((16, 20, 24)), st.integers(16, 24))
    K, V = draw(size), draw(size)
    init = draw(st.booleans())
    scale = draw(st.one_of(st.none(), st.floats(0.1, 2.0, allow_nan=False, allow_infinity=False)))
    seed = draw(st.integers(0, 2**31 - 1))
    return Case(B, T, H, HV, K, V, cu, init, scale, seed), draw(st.booleans())


@pytest.mark.slow
@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate),  # no shrinking: each run costs seconds; the
          suppress_health_check=[HealthCheck.too_slow])  # message below reproduces the case as drawn
@given(text=st.one_of(axis_specs(), explicit_specs()), drawn=grad_cases())
def test_random_spec_chunk_gradients_match_reference(text, drawn):
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1)
    how = repro(f"lrdsl.compile(text={text!r})", case, output_final_state, case.seed + 1)
    assert not failures, f"failing {describe(failures)}\nall: {describe(errors)}\nreproduce: {how}"


# ---- keep_intermediates ----------------------------------------------------------------------
# "kept": the staged kernels, whose backward reads what their forward kept (one pass of stages 1
# to 3, _staged_states, in all); "general": the general kernels keeping theirs (general_kernels).
# The specs: the fused solve and WY stage (gated_deltanet), an erase with a decay per key channel
# (kda), decayed keys from the solve (gla), the decay prefix (mamba2), an auxiliary state (precond_kda)
KEEP = [("gated_deltanet", "kept"), ("kda", "kept"), ("gated_deltanet", "general")]
SLOW_KEEP = [("gla", "kept"), ("mamba2", "kept"), ("precond_kda", "kept"), ("kda", "general"), ("precond_kda", "general")]


@pytest.mark.parametrize("stem,path", KEEP + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_KEEP],
                         ids=lambda v: str(v))
def test_keep_intermediates_gives_the_same_gradients(stem, path, compiled, monkeypatch):
    spec = ROOT / "examples" / f"{stem}.lr"
    recompute, kept = compiled(spec), compiled(spec, keep_intermediates=True)
    assert kept.keep_intermediates and not recompute.keep_intermediates and kept.kernels is recompute.kernels
    calls, states = [], kept.kernels._staged_states
    monkeypatch.setattr(kept.kernels, "_staged_states", lambda *a, **k: calls.append(1) or states(*a, **k))
    # packed sequences, the second of two staged chunks (64 tokens)
    case = Case(B=1, T=90, H=1, HV=2, K=20, V=16, cu_seqlens=(0, 11, 90), initial_state=True, seed=21)
    x, opts = draw_inputs(recompute, case, "cpu")
    h0 = opts.pop("initial_state")
    do, dS = upstream((case.B, case.T, case.HV, case.V), (case.N, case.HV, case.K, case.V), 22)
    o1, S1, g1 = gradients(recompute.chunk, x, h0, dict(opts), do, dS, torch.float32)
    assert len(calls) == 2, f"{stem}: the recompute path made stages 1 to 3 {len(calls)} times, not twice"
    if path == "general":
        general_kernels(kept, monkeypatch)
    calls.clear()
    o2, S2, g2 = gradients(kept.chunk, x, h0, dict(opts), do, dS, torch.float32)
    want = 1 if path == "kept" else 0
    assert len(calls) == want, f"{stem} {path}: stages 1 to 3 made {len(calls)} times, not {want}"
    # the recompute path takes the staged kernels: the general ones are a different algorithm, and
    # either agrees with it to the kernel tolerance
    assert rms_ratio(o2, o1) < TOL and rms_ratio(S2, S1) < TOL
    assert set(g1) == set(g2) == {*recompute.inputs, "initial_state"}
    diffs = {n: rms_ratio(g2[n], g1[n]) for n in g1}
    assert all(d < TOL for d in diffs.values()), f"{stem}: kept vs recomputed: {describe(diffs)}"
    # and both are right (not the same wrong answer)
    _, _, ref = gradients(recompute.reference, x, h0, dict(opts), do, dS, torch.float64)
    errs = {n: rms_ratio(g2[n], ref[n]) for n in ref}
    assert all(e < tolerance(n) for n, e in errs.items()), f"{stem}: kept vs reference: {describe(errs)}"


@pytest.mark.parametrize("path", ["kept", "general"])
def test_kept_intermediates_are_freed_by_the_backward(path, compiled, monkeypatch):
    """The backward takes the kept intermediates over (freed with it, not with the graph): a second
    backward through a retained graph recomputes them (the staged path: one more pass of stages 1
    to 3) and gets the same gradients."""
    import weakref

    import lrdsl.runtime.autograd as ag
    mixer = compiled(ROOT / "examples" / "gated_deltanet.lr", keep_intermediates=True)
    if path == "general":
        general_kernels(mixer, monkeypatch)
    kept, forward = [], ag.chunk_forward

    def spy(*args, **kwargs):  # a weak reference to the dict the forward keeps
        r = forward(*args, **kwargs)
        kept.append(weakref.ref(r[0].saved["hs"]))
        return r
    monkeypatch.setattr(ag, "chunk_forward", spy)
    calls, states = [], mixer.kernels._staged_states
    monkeypatch.setattr(mixer.kernels, "_staged_states", lambda *a, **k: calls.append(1) or states(*a, **k))
    case = Case(B=1, T=40, H=1, HV=2, K=16, V=8, cu_seqlens=(0, 17, 40), initial_state=True, seed=27)
    x, opts = draw_inputs(mixer, case, DEVICE)
    leaves = [t.clone().requires_grad_() for t in (*x.values(), opts.pop("initial_state"))]
    w = torch.randn(1, 40, 2, 8, generator=torch.Generator().manual_seed(28)).to(DEVICE)
    loss = (mixer.chunk(**dict(zip(x, leaves)), initial_state=leaves[-1], **opts)[0] * w).sum()
    assert len(kept) == 1 and kept[0]() is not None
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    assert kept[0]() is None, "the kept chunk states outlive the backward"
    n = len(calls)
    second = torch.autograd.grad(loss, leaves)
    assert len(calls) == n + (path == "kept"), f"{path}: {len(calls) - n} passes of stages 1 to 3 in the second backward"
    assert all(torch.isfinite(a).all() and rms_ratio(b, a) < 1e-5 for a, b in zip(first, second))


@pytest.mark.parametrize("stem", ["gated_deltanet", "deltanet", "kda", "gla", "mamba2", "precond_kda"])
def test_kept_staged_states_are_what_the_backward_would_make(stem, compiled):
    """What chunk_fwd(..., keep=True) keeps for staged_bwd is what staged_bwd's own pass of stages 1
    to 3 (_staged_states from the forward's solve) makes: every tensor to rounding, non-finite in
    the same places, the same chunks flagged dirty (an inf in v), None where that pass has None. (On
    the CPU they are equal bit for bit but with the decayed keys from the solve, gla's: 4e-6.)"""
    mixer = compiled(ROOT / "examples" / f"{stem}.lr")
    mod = mixer.kernels
    case = Case(B=1, T=150, H=1, HV=2, K=20, V=12, cu_seqlens=(0, 41, 150), initial_state=True, seed=25)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x["v"][0, 41 + 64 + 9, 1, 3] = float("inf")  # the second sequence's second chunk, value head 1
    inputs, cu, scale = {n: t.contiguous() for n, t in x.items()}, opts["cu_seqlens"].to(torch.int64), case.K ** -0.5
    r = mod.chunk_fwd(inputs, scale, opts["initial_state"], True, cu, keep=True)
    assert r.saved is not None and r.saved["staged"]
    again = mod._staged_states(inputs, scale, opts["initial_state"], False, cu, r.residual,
                               keep_aux=bool(mod.CHAIN_AUX))
    assert again["dirty"].sum() > 0 and torch.equal(r.saved["dirty"], again["dirty"])
    tol = 1e-5 if DEVICE == "cpu" else TOL  # the GPU's products may round in another order
    for n, got in r.saved.items():
        if n in ("staged", "args", "dirty"):
            continue
        want = again[n]
        pairs = list(zip(got, want)) if isinstance(got, (list, tuple)) else [(got, want)]
        assert len(pairs) == (len(want) if isinstance(want, (list, tuple)) else 1), n
        for a, b in pairs:
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
                assert (a is None and b is None) or a == b, f"{stem}: {n} kept {a!r}, made again {b!r}"
                continue
            fin = torch.isfinite(b)
            assert torch.equal(torch.isfinite(a), fin), f"{stem}: {n} not finite in other places"
            assert rms_ratio(a[fin], b[fin]) < tol, f"{stem}: {n} {rms_ratio(a[fin], b[fin]):.3g}"
    assert [a is b for a, b in zip(r.saved["args"], again["args"])][:len(inputs)] == [True] * len(inputs)


# ---- torch.compile ---------------------------------------------------------------------------
# precond_kda: a decay per key channel, shared inputs, an auxiliary state; kda_decay_after_erase: split
@pytest.mark.parametrize("name", [pytest.param("precond_kda", marks=pytest.mark.slow), "kda_decay_after_erase"])
def test_torch_compile_fullgraph_matches_eager(name, compiled):
    from torch._dynamo.testing import CompileCounterWithBackend

    mixer = compiled(ROOT / "examples" / f"{name}.lr")
    case = Case(B=1, T=23, H=1, HV=2, K=16, V=16, initial_state=True, seed=31)
    x, opts = draw_inputs(mixer, case, DEVICE)
    h0 = opts.pop("initial_state")
    do, dS = upstream((case.B, case.T, case.HV, case.V), (case.N, case.HV, case.K, case.V), 32)
    do, dS = do.to(DEVICE), dS.to(DEVICE)
    names = list(x)

    def f(h0, *xs):
        o, S = mixer.chunk(**dict(zip(names, xs)), initial_state=h0, output_final_state=True, scale=0.5)
        if isinstance(S, lrdsl.MixerState):  # the whole state
            return (o * do).sum() + (S.S * dS).sum() + 0 * sum(t.sum() for t in S.aux.values())
        return (o * do).sum() + (S * dS).sum()

    def run(fn):
        leaves = [h0.clone().requires_grad_(), *(x[n].clone().requires_grad_() for n in names)]
        loss = fn(*leaves)
        return loss.detach(), torch.autograd.grad(loss, leaves)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled_f = torch.compile(f, backend=counter, fullgraph=True)  # fullgraph: a graph break raises
    loss_c, grads_c = run(compiled_f)
    loss_e, grads_e = run(f)
    assert counter.frame_count == 1, f"{counter.frame_count} graphs compiled"
    assert abs(loss_c.item() - loss_e.item()) <= 1e-6 * abs(loss_e.item()) + 1e-6
    for n, gc, ge in zip(["initial_state", *names], grads_c, grads_e):
        assert gc is not None and gc.shape == ge.shape
        assert rms_ratio(gc, ge) < 1e-6, f"d{n}: compiled vs eager {rms_ratio(gc, ge):.3g}"
    loss_c2, _ = run(compiled_f)  # a second call reuses the graph
    assert counter.frame_count == 1 and torch.allclose(loss_c2, loss_c)


def test_second_derivative_through_the_kernels_raises(compiled):
    """An eager call goes through ChunkFunction (autograd.eager), whose gradients have no
    derivative: under create_graph a backward through them raises, as through the custom op, rather
    than giving a silent zero."""
    mixer = compiled(ROOT / "examples" / "linear_attention.lr")
    x, opts = draw_inputs(mixer, Case(B=1, T=20, H=1, HV=1, K=16, V=16, seed=5), DEVICE)
    q = x["q"].clone().requires_grad_()
    o, _ = mixer.chunk(**dict(x, q=q), **opts)
    (dq,) = torch.autograd.grad((o * o).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="not differentiable"):
        dq.sum().backward()


# ---- recurrent is forward-only ---------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "beta", "initial_state"])
def test_recurrent_refuses_inputs_that_require_grad(which, compiled):
    mixer = compiled(ROOT / "examples" / "gated_deltanet.lr")
    case = Case(B=1, T=9, H=1, HV=1, K=16, V=16, initial_state=True, seed=41)
    x, opts = draw_inputs(mixer, case, DEVICE)
    if which == "initial_state":
        opts["initial_state"].requires_grad_()
    else:
        x[which].requires_grad_()
    with pytest.raises(lrdsl.InputError, match="forward-only") as e:
        mixer.recurrent(**x, **opts)
    assert "no_grad" in str(e.value) and "chunk" in str(e.value)
    with torch.no_grad():
        o, S = mixer.recurrent(**x, **opts)
    assert not o.requires_grad and not S.requires_grad
    ref_o, ref_S = mixer.reference(**{n: t.detach().double() for n, t in x.items()},
                                   **dict(opts, initial_state=opts["initial_state"].detach().double()))
    assert rms_ratio(o, ref_o) < TOL_QKV and rms_ratio(S, ref_S) < TOL_QKV


# ---- lrdsl fuzz checks gradients (--grad, the default) ---------------------------------------
@pytest.fixture
def reference_with_wrong_beta_gradient(monkeypatch):
    """The reference's forward is unchanged, but its gradient for beta is off by 1e-2 * do.sum()."""
    import lrdsl.api

    real = lrdsl.api.Mixer.reference

    def wrong(self, *args, **kwargs):
        o, s = real(self, *args, **kwargs)
        beta = kwargs["beta"]
        return o + 1e-2 * (beta - beta.detach()).sum(), s

    monkeypatch.setattr(lrdsl.api.Mixer, "reference", wrong)


@pytest.mark.slow
def test_fuzz_catches_a_gradient_only_error(reference_with_wrong_beta_gradient, compiled, capsys):
    import contextlib
    import io

    from lrdsl import cli
    from lrdsl.fuzz import run_fuzz

    mixer = compiled(ROOT / "examples" / "gated_deltanet.lr")
    result = run_fuzz(mixer, examples=3, device="cpu", seed=1)  # gradients on by default
    assert not result.ok and "dbeta" in result.failure.message and "dq" not in result.failure.message
    code = result.failure.snippet
    with pytest.raises(AssertionError, match="beta"), contextlib.redirect_stdout(io.StringIO()):
        exec(compile(code, "<snippet>", "exec"), {"__name__": "__snippet__"})  # noqa: S102
    # without gradients the same (forward-identical) reference passes
    assert run_fuzz(mixer, examples=2, device="cpu", seed=1, grad=False).ok
    assert cli.main(["fuzz", str(ROOT / "examples" / "gated_deltanet.lr"), "--examples", "2", "--seed", "1",
                     "--device", "cpu", "--no-grad"]) == 0
    out = capsys.readouterr().out
    assert "passed" in out and "gradients" not in out


@pytest.mark.slow
def test_fuzz_command_reports_gradients_by_default(compiled, capsys):
    from lrdsl import cli

    assert cli.main(["fuzz", str(ROOT / "examples" / "kda.lr"), "--examples", "2", "--seed", "3",
                     "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "2 examples passed" in out and "chunk gradients worst rms ratio q, k, v, h0" in out, out


def test_first_order_scan_matches_a_token_loop():
    """The doubling scan behind the chain rule of auxiliary states, against the plain recurrence,
    with resets (alpha = 0) where sequences start."""
    from lrdsl.runtime.autograd import first_order_scan
    gen = torch.Generator().manual_seed(5)
    alpha = torch.rand(2, 45, 3, 7, generator=gen, dtype=torch.float64)
    alpha[:, [0, 11, 12, 40]] = 0.0
    beta = torch.randn(2, 45, 3, 7, generator=gen, dtype=torch.float64)
    p, rows = torch.zeros_like(beta[:, 0]), []
    for t in range(45):
        p = alpha[:, t] * p + beta[:, t]
        rows.append(p)
    assert rms_ratio(first_order_scan(alpha, beta), torch.stack(rows, 1)) < 1e-14


# ---- the generated chain rule ----------------------------------------------------------------
CHAINED = """mixer chained
input q[K] l2norm, k[K] l2norm, v[V], g log, b, w[V] in [0, 1]
let beta = sigmoid(b)
let kk = beta * k
S = (I - kk k^T) exp(g * (1 + h/4)) S + kk (w*v)^T
o = S^T q
"""


# a decay per key channel: its log-decay is a key-channel vector of the chain rule, made of a
# per-channel input and a per-head one (whose terms are summed over the channels)
CHAINED_DIAG = """mixer chained_diag
input q[K] l2norm, k[K] l2norm, v[V], a[K], c log, b
let beta = sigmoid(b)
S = (I - beta k k^T) diag(exp(c - softplus(a))) S + beta k v^T
o = S^T q
"""


@pytest.mark.parametrize("case_id", default_first(list(CASES), DEFAULT_CASE))
@pytest.mark.parametrize("text,wanted", [(CHAINED, {"db", "dw", "dg"}), (CHAINED_DIAG, {"da", "dc", "db"})],
                         ids=["scalar decay", "per-channel decay"])
def test_generated_chain_rule_through_lets_gates_heads_and_clamps(text, wanted, case_id, compiled):
    """A staged spec's backward ends in the generated chain-rule kernel (not PyTorch's): through
    a let chain, a sigmoid gain, the head index in the decay, a clamped gate, a per-channel
    decay, grouped value heads and packed sequences. Gradients against the reference."""
    mixer = compiled(None, text=text)
    assert mixer.kernels.HAS_CHAIN_RULE
    calls = []
    original = mixer.kernels.chain_rule
    mixer.kernels.chain_rule = lambda *a: calls.append(1) or original(*a)
    try:
        case = CASES[case_id]
        errors, failures = compare(mixer, case, output_final_state=True, seed=7)
        assert not failures, f"{case}: failing {describe(failures)}\nall: {describe(errors)}"
        assert wanted <= set(errors)
    finally:
        mixer.kernels.chain_rule = original
    assert len(calls) == 1


def test_direct_chain_rule_runs_no_kernel():
    """Where every input's gradient is one per-token vector's (Chain.direct: mamba2's q, k, v and
    g), no chain kernel runs: dq is scaled inside the staged backward, q's and k's are summed over
    grouped value heads, g's is zero where g was clamped (> 0) or floored (< -20) by the kernels.
    Gradients against the float64 reference; specs with an L2 norm or a gate keep the kernel."""
    from lrdsl.codegen.plan import plan
    direct = lambda stem: plan(lrdsl.compile(ROOT / "examples" / f"{stem}.lr", load_kernels=False).ir).chain.direct
    assert [d[:2] for d in direct("linear_attention")] == [("q", "r"), ("k", "u"), ("v", "z")]
    assert direct("retnet") and not direct("gated_deltanet") and not direct("gla") and not direct("deltanet")
    assert direct("mamba2")[-1] == ("g", "gl", "", "0.0")
    mixer = lrdsl.compile(ROOT / "examples" / "mamba2.lr", check_ranges=False)
    assert not hasattr(mixer.kernels, "staged_chain_kernel")

    def edit(x):
        x["g"][0, 3::9, 1] = 0.4  # clamped to 0: a gradient of zero there
        x["g"][0, 7::11, 2] = -25.0  # floored at -20: the same

    case = Case(B=1, T=70, H=2, HV=4, K=20, V=12, initial_state=True, scale=0.7, seed=41)
    errors, failures = compare(mixer, case, output_final_state=True, seed=42, edit=edit)
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    assert {"dq", "dk", "dv", "dg"} <= set(errors)


# an erase with a decay per token and head, whose chain rule staged_dk applies in its epilogue
# (plan.chain_in_dk): inputs shared by grouped value heads (q, k and b), a clamped one (b), the head
# index in the decay and a param per key channel (w, its gradient per token summed by the host)
FUSED = """mixer fused_chain
input q[K] l2norm, k[K] l2norm, v[V], a, b shared in [-4, 4]
param w[K] in [0, 1] init 0.5
let beta = sigmoid(b)
let kw = beta * w * k
S = (I - kw k^T) exp(-softplus(a) * (1 + h/4)) S + kw v^T
o = S^T q
"""


def test_staged_dk_takes_the_chain_rule_of_scalar_decay_delta_rules():
    """gated_deltanet's and deltanet's backward generates no chain kernel: staged_dk ends in the
    chain rule (_chain_tokens) and stores the inputs' gradients, and q's is made where r's is (in
    staged_dk, or in staged_dr where stage 3 splits: plan.split_dk); a decay per key channel (kda)
    and a gated write value (CHAINED: its gradient needs dz) keep the kernel."""
    from lrdsl.codegen.generate import generate
    source = lambda m: generate(m.ir)
    # (stem, stage 3's first kernel, the kernel that makes r's gradient)
    for stem, first, r_kernel in (("gated_deltanet", "staged_de_kernel", "staged_dr_kernel"),
                                  ("deltanet", "staged_dk_kernel", "staged_dk_kernel")):
        text = source(lrdsl.compile(ROOT / "examples" / f"{stem}.lr", load_kernels=False))
        assert "staged_chain_kernel" not in text, stem
        dk = text[text.index("def staged_dk_kernel("):text.index("def staged_bwd(")]
        assert "    _chain_tokens(" in dk and "tl.store(du_ptr" not in dk, stem
        # q's gradient where r's is made (plan.chain_at_dr): r's neither stored nor read back
        dr = text[text.index(f"def {r_kernel}("):]
        assert "    _chain_at_dr(in_q, b_dr, d_q_ptr," in dr[:dr.index("\n\n\n")], stem
        assert "dr_ptr" not in text[text.index(f"def {first}("):], stem
    assert "def staged_chain_kernel(" in source(lrdsl.compile(ROOT / "examples" / "kda.lr", load_kernels=False))
    assert "def staged_chain_kernel(" in source(lrdsl.compile(text=CHAINED, load_kernels=False))


# GATED_QUERY's query is q times a gate of a: q's chain rule term is not a number and a's reads r's
# gradient too, so staged_dk keeps storing r's gradient for _chain_tokens (plan.chain_at_dr off)
GATED_QUERY = """mixer gated_query
input q[K] l2norm, k[K] l2norm, v[V], a, b in [0, 1]
let qa = sigmoid(a) * q
S = (I - b k k^T) exp(-softplus(a)) S + b k v^T
o = S^T qa
"""


def test_chain_at_dr_only_where_q_alone_reads_r():
    """plan.chain_at_dr: the examples whose staged_dk ends in the chain rule make q's gradient where
    r's is made (DeltaProduct's through its direct sub-mixer, whose query is the spec's q); a query
    gated by another input keeps r's gradient in memory."""
    from lrdsl.codegen.plan import plan
    at = {p.stem: plan(rendered_ir(p)).chain_at_dr for p in EXAMPLES}
    assert {s: l.name for s, l in at.items() if l} == {s: "q" for s in (
        "deltanet", "gated_deltanet", "gated_deltanet_gates", "gated_deltanet_negeig", "comba",
        "delta_product2", "delta_product3")}, at
    gated = plan(lrdsl.compile(text=GATED_QUERY, load_kernels=False).ir)
    assert gated.chain_in_dk and gated.chain_at_dr is None


def _chain_tokens_lines(ir) -> list:
    """The lines of the generated _chain_tokens (staged_dk's chain-rule epilogue) after its setup."""
    from lrdsl.codegen.generate import generate
    text = generate(ir)
    body = text[text.index("def _chain_tokens("):]
    body = body[:body.index("\n\n\n")]
    return [ln.strip() for ln in body[body.index("p_tk = "):].splitlines() if ln.strip()]


def _first(lines, pattern) -> int:
    import re
    return next(i for i, ln in enumerate(lines) if re.search(pattern, ln))


# comba with its erase read gated by an input a: p's gradient is c's times a gate, and a's reads c's
# gradient and p, so c's gradient goes through memory to staged_dk's chain rule (plan.chain_at_dc off)
GATED_ERASE = """mixer gated_erase
input q[K] l2norm, k[K] l2norm, p[K] l2norm, v[V]
input g log
input beta in (0, 1), a
let pa = sigmoid(a) * p
S = (I - beta k pa^T) exp(g) S + beta k v^T
o = S^T q
allow unstable
"""


def test_chain_at_dc_only_where_c_alone_reads_its_input():
    """plan.chain_at_dc: comba's p (c = p through its L2 norm, read by no other gradient) has its
    gradient made in staged_de, where c's is: staged_de takes p's gradient's pointer, not dc's, and
    staged_dk neither takes dc nor loads p. Where c's input is u's too (gated_deltanet's k) or c is
    gated by another input (GATED_ERASE), c's gradient goes through memory as before."""
    from lrdsl.codegen.generate import generate
    from lrdsl.codegen.plan import plan
    at = {p.stem: plan(rendered_ir(p)).chain_at_dc for p in EXAMPLES}
    assert {s: l.name for s, l in at.items() if l} == {"comba": "p"}, at
    gated = plan(lrdsl.compile(text=GATED_ERASE, load_kernels=False).ir)
    assert gated.split_dr and gated.chain_at_dc is None
    text = generate(rendered_ir(ROOT / "examples" / "comba.lr"))
    de = text[text.index("def staged_de_kernel("):text.index("def staged_dr_kernel(")]
    assert "_chain_at_dc(in_p, " in de and "dc_ptr" not in de
    dk = text[text.index("def staged_dk_kernel("):text.index("def staged_bwd(")]
    tokens = text[text.index("def _chain_tokens("):]
    tokens = tokens[:tokens.index("\n\n\n")]
    assert "dc_ptr" not in dk and "dc_ptr" not in tokens and "in_p +" not in tokens


@pytest.mark.slow  # gated_deltanet's tests cover c's gradient through memory in the default tier
def test_gated_erase_gradients_read_cs_back(compiled):
    """GATED_ERASE (plan.split_dr without plan.chain_at_dc): staged_de stores c's gradient and
    staged_dk's chain rule reads it back for p's and a's; every gradient matches the float64
    reference."""
    mixer = compiled(None, text=GATED_ERASE)
    errors, failures = compare(mixer, CASES[DEFAULT_CASE], output_final_state=True, seed=41)
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    assert {"dq", "dk", "dp", "da", "dbeta", "dg"} <= set(errors)


def test_chain_tokens_loads_a_tile_after_the_stores_that_do_not_need_it():
    """GATED_ERASE's _chain_tokens (codegen/chain_order.py): k's tile is loaded and dies first
    (s_beta, the other reader of b_du and b_k, comes before k's gradient), and p's tile and c's
    gradient are loaded only after k's gradient is stored, so never live with k's, b_du and g_x
    (comba's spilled 488/556 with every tile loaded at the top, before plan.chain_at_dc took p's
    out; docs/kernels.md)."""
    lines = _chain_tokens_lines(lrdsl.compile(text=GATED_ERASE, load_kernels=False).ir)
    store_k = _first(lines, r"^tl\.store\(d_k_ptr")
    assert _first(lines, r"^b_k = tl\.load") < _first(lines, r"^s_beta = .*\bb_du\b") < store_k
    assert store_k < _first(lines, r"^b_p = tl\.load")
    assert store_k < _first(lines, r"^b_dc = tl\.load")


def test_chain_order_puts_an_unread_statement_after_what_it_reads():
    """chain_order.order: a statement no gradient reads (here the log-decay's floor) stays at the top,
    and so does the load it reads, though a gradient reads that load too and would pull it later."""
    from lrdsl.codegen.chain_order import Stmt, order
    from lrdsl.codegen.plan import Load
    a = Stmt("input_load", Load("a", "b_a", "scalar", False, False), ("b_a",))
    k = Stmt("input_load", Load("k", "b_k", "K", False, False), ("b_k",), tile=True)
    floor = Stmt("floor", None, ("b_dgl",), frozenset({"b_a"}))
    grad = Stmt("key_grad", k.arg, (), frozenset({"b_du", "b_k", "b_a"}), consumer=True)
    out = order((a, k, floor, grad))
    assert sorted(map(id, out)) == sorted(map(id, (a, k, floor, grad)))
    assert out.index(a) < out.index(floor) and out.index(k) < out.index(grad)


@pytest.mark.parametrize("spec", ["comba", "gated_deltanet", "gated_deltanet_gates", "delta_product3", "deltanet",
                                  "FUSED", "GATED_QUERY"])
def test_chain_tokens_loads_each_tile_right_before_its_first_reader(spec):
    """Every [BT, BK] tile _chain_tokens loads (c's and r's gradients, each key-channel input) is
    loaded after the last store before its first reader: a load cannot move below a store to
    another pointer, so one loaded earlier stays live through that store's gradient."""
    import re
    text = {"FUSED": FUSED, "GATED_QUERY": GATED_QUERY}.get(spec)
    ir = lrdsl.compile(text=text, load_kernels=False).ir if text else rendered_ir(ROOT / "examples" / f"{spec}.lr")
    lines = _chain_tokens_lines(ir)
    tiles = [m.group(1) for ln in lines for m in [re.match(r"(b_\w+) = tl\.load\(.*(p_tk|o_k\[None, :\])", ln)] if m]
    assert "b_k" in tiles, tiles
    for tile in tiles:
        load = _first(lines, rf"^{tile} = tl\.load")
        # its first reader: a line that reads it, not its own normalisation or clamp
        use = next(i for i, ln in enumerate(lines) if i > load and re.search(rf"\b{tile}\b", ln)
                   and not re.match(rf"(n_{tile[2:]}|{tile}) = ", ln))
        assert not any("tl.store(" in ln for ln in lines[load:use]), (spec, tile, lines[load:use + 1])


@pytest.mark.parametrize("case_id", default_first(list(CASES), DEFAULT_CASE))
def test_chain_rule_in_staged_dk_matches_reference(case_id, compiled):
    """FUSED's gradients from staged_dk's epilogue (no chain kernel) against the float64
    reference, b also outside its range (clamped there: a gradient of zero)."""
    mixer = compiled(None, text=FUSED, check_ranges=False)
    assert not hasattr(mixer.kernels, "staged_chain_kernel")

    def edit(x):
        x["b"][0, 2::7, 0] = 6.0

    errors, failures = compare(mixer, CASES[case_id], output_final_state=True, seed=17, edit=edit)
    assert not failures, f"{case_id}: failing {describe(failures)}\nall: {describe(errors)}"
    assert {"dq", "dk", "da", "db", "dw"} <= set(errors)


def test_gated_query_gradients_read_rs_back(compiled):
    """GATED_QUERY (plan.split_dr without plan.chain_at_dr): staged_dr stores r's gradient and
    staged_dk's chain rule reads it back for q's and a's; both match the float64 reference."""
    mixer = compiled(None, text=GATED_QUERY)
    assert hasattr(mixer.kernels, "staged_dr_kernel") and not hasattr(mixer.kernels, "staged_chain_kernel")
    errors, failures = compare(mixer, CASES[DEFAULT_CASE], output_final_state=True, seed=37)
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    assert {"dq", "dk", "da", "db"} <= set(errors)


@pytest.mark.parametrize("split", [True, False], ids=["three launches", "one launch"])
def test_stage_three_takes_three_launches_with_an_erase(split, monkeypatch):
    """plan.split_dk: with an erase and a decay per token and head, the gradients from dE take a
    launch of their own (staged_de) before staged_dk; never without an erase, without a decay
    (deltanet: the split was slower on the H200) or with a decay per key channel. plan.split_dr:
    where staged_dk ends in the chain rule, those from dO take one too (staged_dr). Either way (the
    one-launch kernel by a plan whose route has both off) gated_deltanet's gradients match the float64
    reference, and each stage-3 kernel runs once per backward."""
    from lrdsl.codegen import generate as generate_module
    from lrdsl.codegen.plan import plan
    plans = {p.stem: plan(rendered_ir(p)) for p in EXAMPLES}
    assert {s for s, p in plans.items() if p.split_dk} == {"gated_deltanet", "gated_deltanet_gates",
                                                          "gated_deltanet_negeig", "precond_deltanet",
                                                          "channel_gates_scalar_decay", "comba",
                                                          "delta_product2", "delta_product3"}, plans
    assert {s for s, p in plans.items() if p.split_dr} == {"gated_deltanet", "gated_deltanet_gates",
                                                          "gated_deltanet_negeig", "comba",
                                                          "delta_product2", "delta_product3"}
    if not split:
        def one_launch(m):
            p = plan(m)
            return dataclasses.replace(p, route=dataclasses.replace(p.route, split_dk=False, split_dr=False))
        monkeypatch.setattr(generate_module, "plan", one_launch)  # the plan lrdsl.compile renders
    mixer = lrdsl.compile(ROOT / "examples" / "gated_deltanet.lr")
    source = generate_module.generate(mixer.ir)
    for kernel in ("staged_de_kernel", "staged_dr_kernel"):
        assert (f"def {kernel}(" in source) == split == hasattr(mixer.kernels, kernel)
    names = ("staged_de", "staged_dr", "staged_dk") if split else ("staged_dk",)
    launches = {n: count_launches(monkeypatch, mixer.kernels, n) for n in names}
    errors, failures = compare(mixer, CASES[DEFAULT_CASE], output_final_state=True, seed=29)
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    assert {n: len(g) for n, g in launches.items()} == dict.fromkeys(launches, 1)


def test_stage_three_takes_two_launches_without_the_chain_rule(monkeypatch):
    """plan.split_dk without plan.split_dr (precond_deltanet: a chain kernel after staged_dk):
    staged_de, then one staged_dk, and the gradients match the float64 reference."""
    mixer = lrdsl.compile(ROOT / "examples" / "precond_deltanet.lr")
    assert hasattr(mixer.kernels, "staged_de_kernel") and not hasattr(mixer.kernels, "staged_dr_kernel")
    launches = {n: count_launches(monkeypatch, mixer.kernels, n) for n in ("staged_de", "staged_dk")}
    errors, failures = compare(mixer, CASES[DEFAULT_CASE], output_final_state=True, seed=31)
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    assert {n: len(g) for n, g in launches.items()} == dict.fromkeys(launches, 1)


@pytest.mark.parametrize("name", ["gated_deltanet", "kda", "gla"])
def test_backward_reuses_the_forwards_solve(name, compiled, monkeypatch):
    """The staged forward hands what its solve made (the WY inverse X; with a decay per key
    channel also the pairwise sums P) to the backward, which then recomputes the chunk states
    without solving again: one solve launch per training step, and the same gradients as the
    float64 reference."""
    from lrdsl.codegen.plan import plan
    mixer = compiled(next(p for p in EXAMPLES if Path(p).stem == name))
    mod = mixer.kernels
    assert mod.keeps_residual(16) and not mod.keeps_residual(mod.STAGED_MAX_K + 1)
    # gated_deltanet's forward solves inside staged_solve_wy (plan.solve_wy_fused), which only the
    # forward launches: the backward recomputes W and U with staged_wy from the X it stored
    fused = plan(mixer.ir).solve_wy_fused
    assert fused == (name == "gated_deltanet") and hasattr(mod, "staged_solve") != fused
    launches = count_launches(monkeypatch, mod, "staged_solve_wy" if fused else "staged_solve")
    # with an erase and a decay per key channel, the inverse's own launch (plan.split_solve)
    inverses = count_launches(monkeypatch, mod, "staged_inverse") if hasattr(mod, "staged_inverse") else [()]
    errors, failures = compare(mixer, CASES[next(iter(CASES))], output_final_state=True, seed=3)
    assert not failures, describe(failures)
    # one solve: its launches of one forward (a decay per key channel: tensor cores, then the exact
    # path over the chunks that need it)
    assert len(launches) == len(mod.EXACT_PASSES), f"the solve launched {len(launches)} times in one forward + backward"
    assert len(inverses) == 1, f"the inverse launched {len(inverses)} times in one forward + backward"


# strong=True has both kinds of blocks (one takes the exact path, the others tensor cores): pytest -q;
# strong=False (tensor cores only) under -m slow
@pytest.mark.parametrize("strong", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["tensor-core blocks", "exact blocks"])
@pytest.mark.parametrize("name", ["kda", "gla", "precond_kda"])
def test_staged_backward_for_per_channel_decays(name, strong, monkeypatch):
    """The staged backward with a decay per key channel takes its pairwise gradients by 16-token
    blocks; a diagonal block that decays past exp(-SPAN) in some channel goes column by column
    (strong=True: four tokens of log-decay -30, floored at -20 each, in one channel of one block).
    Gradients of every input and of h0 against the float64 reference, packed sequences."""
    from lrdsl.codegen.plan import Plan
    mixer = lrdsl.compile(next(p for p in EXAMPLES if p.stem == name))
    launches = count_launches(monkeypatch, mixer.kernels, "staged_dk")
    flags = pair_flags(monkeypatch, mixer.kernels)

    def edit(x):
        if strong:
            assert 4 * -Plan.log_decay_floor > Plan.diagonal_block_span
            x["g"][0, 70:74, 1, 5] = -30.0  # rows 70..73: one block (69..84) of the second sequence

    case = Case(B=1, T=100, H=2, HV=2, K=32, V=24, cu_seqlens=(0, 37, 100), initial_state=True, seed=31)
    errors, failures = compare(mixer, case, output_final_state=True, seed=5, edit=edit)
    assert launches, "the staged backward did not run"
    assert not failures, f"failing {describe(failures)}; all: {describe(errors)}"
    # the pair stage's first launch leaves to its second exactly the (head, chunk) whose block decays
    # past exp(-SPAN): head 1 of the second sequence's one chunk; flags (sequence, head)-major
    assert len(flags) == 1, f"the pair stage's first launch ran {len(flags)} times"
    assert flags[0].tolist() == ([0, 0, 0, 1] if strong else [0, 0, 0, 0]), flags[0].tolist()


def pair_flags(monkeypatch, module) -> list:
    """The flags each first launch of a module's staged_pair_kernel set (for the test): which (sequence,
    head, chunk, key slice) it left to its second launch, the exact diagonal blocks."""
    out, original = [], module.staged_pair_kernel

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                original[grid](*args, **kw)
                if not kw["EXACT"]:
                    out.append(args[-3].clone())  # (exact, NCK, n_pairs)
            return launch

    monkeypatch.setattr(module, "staged_pair_kernel", Recording())
    return out


# linear_attention (no decay) and gla (a decay per key channel) in pytest -q; the scalar decays under -m slow
@pytest.mark.parametrize("stem", ["linear_attention", pytest.param("retnet", marks=pytest.mark.slow),
                                  pytest.param("mamba2", marks=pytest.mark.slow), "gla"])
def test_state_passes_split_over_key_channels(stem, compiled):
    """Without an erase both state passes may split the state's rows over programs
    (plan.state_split_k; the reverse one for decays that are not per key channel): three slices of
    16 key channels, the last one partial, give the reference's gradients."""
    import triton
    mixer = compiled(ROOT / "examples" / f"{stem}.lr")
    k = mixer.kernels
    split = {"staged_state": k.staged_state}
    if stem != "gla":
        split.update(staged_dstate=k.staged_dstate, staged_dstate_fp32=k.staged_dstate_fp32)
    saved = {n: t.configs for n, t in split.items()}
    for t in split.values():
        t.configs = [triton.Config({"BV": 16, "BKS": 16}, num_warps=4, num_stages=1)]
        t.cache.clear()
    try:
        case = Case(B=1, T=150, H=2, HV=2, K=40, V=24, cu_seqlens=(0, 70, 150), initial_state=True, seed=23)
        errors, failures = compare(mixer, case, output_final_state=True, seed=24)
    finally:
        for n, t in split.items():
            t.configs = saved[n]
            t.cache.clear()
    assert not failures, f"{stem}: {describe(errors)}"


# gla (the staged_dk of a decay per key channel) in pytest -q; mamba2 (a scalar decay), kda (with an
# erase) and gated_deltanet (a scalar decay with an erase: BV < 64, no trace) under -m slow. No CPU
# test but this one runs staged_dk over more than one value tile
@pytest.mark.parametrize("stem", [pytest.param("mamba2", marks=pytest.mark.slow), "gla",
                                  pytest.param("kda", marks=pytest.mark.slow),
                                  pytest.param("gated_deltanet", marks=pytest.mark.slow)])
def test_staged_dk_over_several_value_tiles(stem, compiled, monkeypatch):
    """staged_dk's value loop over three tiles of 16 values, the last one partial (forced: the
    interpreter takes the space's first config): the end state's decay gradient <S0, dS> is
    summed over them (mamba2 and gated_deltanet: from the tiles loaded a second time, BV < V; with
    an erase, BV < 64; gla and kda: the per-key-channel backward's register sum).
    Sequences of 5, 65 (a second chunk of one token, whose S0 decays little) and 10 tokens,
    against the float64 reference."""
    import triton
    mixer = compiled(ROOT / "examples" / f"{stem}.lr")
    tuner = mixer.kernels.staged_dk
    saved = tuner.configs
    tuner.configs = [triton.Config({"BV": 16}, num_warps=8, num_stages=1)]
    tuner.cache.clear()
    launches = count_launches(monkeypatch, mixer.kernels, "staged_dk")
    try:
        case = Case(B=1, T=80, H=1, HV=2, K=20, V=40, cu_seqlens=(0, 5, 70, 80), initial_state=True, seed=41)
        errors, failures = compare(mixer, case, output_final_state=True, seed=42)
    finally:
        tuner.configs = saved
        tuner.cache.clear()
    assert launches, "the staged backward did not run"
    assert not failures, f"{stem}: {describe(errors)}"


CLAMPED_V = """mixer clamped_v
input q[K] l2norm, k[K] l2norm, v[V] in [-1, 1], g log, beta in (0, 1)
S = (I - beta k k^T) exp(g) S + beta k v^T
o = S^T q
"""


def test_chain_rule_hands_dz_over_only_where_it_is_the_gradient():
    """The generated chain rule returns the staged backward's dz as v's gradient where z is v
    itself (codegen/chain.py: Chain.v_given); not where v is clamped into a declared range (the
    gradient is zero outside it: checked here with values outside) nor where z is a product."""
    from lrdsl.codegen.plan import plan
    given = lambda m: plan(m.ir).chain.v_given
    assert given(lrdsl.compile(ROOT / "examples" / "gated_deltanet.lr", load_kernels=False)) == ("v",)
    assert given(lrdsl.compile(text=CHAINED, load_kernels=False)) == ()
    m = lrdsl.compile(text=CLAMPED_V, check_ranges=False)  # values outside are clamped
    assert given(m) == ()
    B, T, H, K, V = 1, 40, 2, 16, 16
    x = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=2 * torch.randn(B, T, H, V),
             g=torch.nn.functional.logsigmoid(torch.randn(B, T, H) + 2), beta=torch.rand(B, T, H))
    do = torch.randn(B, T, H, V)

    def grads(fn, dtype):
        leaves = {n: t.to(dtype).clone().requires_grad_() for n, t in x.items()}  # fresh leaves each run
        (fn(**leaves)[0].double() * do.double()).sum().backward()
        return leaves["v"].grad

    got, ref = grads(m.chunk, torch.float32), grads(m.reference, torch.float64)
    assert (ref == 0).any() and (got[ref == 0] == 0).all()
    assert rms_ratio(got, ref) < TOL_QKV


def _autotuned(module, name, configs, hooks):
    """The module's kernel `name` under an autotuner over configs whose timing runs each config
    three times on the call's own tensors (as triton's do_bench does, many times, on the GPU)."""
    import triton

    def bench(call, quantiles=None, **_):
        for _ in range(3):
            call()
        return [1.0, 1.0, 1.0]
    kernel = getattr(module, name).fn
    return triton.autotune(configs, key=["H", "HV", "K", "V", "IS_VARLEN"], do_bench=bench, **hooks)(kernel)


@pytest.mark.parametrize("name", ["gated_deltanet", pytest.param("kda", marks=pytest.mark.slow)])
def test_autotuning_leaves_in_place_gradients_alone(name, compiled, monkeypatch):
    """staged_dk adds to gradients staged_dq stored (with a decay per key channel; with a scalar
    one it writes them). The autotuner times its configs on the call's own tensors, so without its
    restoring hooks every timed launch adds again, and the first backward of a process with an
    empty tuning cache comes out wrong (the GPU suite runs one config per kernel, so only this test
    sees it)."""
    import triton
    mixer = compiled(next(p for p in EXAMPLES if Path(p).stem == name))
    mod = mixer.kernels
    case = CASES[DEFAULT_CASE]
    x, opts = draw_inputs(mixer, case, "cpu")
    h0 = opts.pop("initial_state")
    do, dS = upstream((case.B, case.T, case.HV, case.V), (case.N, case.HV, case.K, case.V), 5)
    opts = dict(opts, output_final_state=True)
    _, _, plain = gradients(mixer.chunk, x, h0, opts, do, dS, torch.float32)
    space = mod.TUNING_SPACE["staged_dk"]
    configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=1) for c in (space[0], space[0])]
    hooks = dict(pre_hook=mod.staged_dk.pre_hook, post_hook=mod.staged_dk.post_hook)  # the module's own
    monkeypatch.setattr(mod, "staged_dk", _autotuned(mod, "staged_dk", configs, hooks))
    _, _, tuned = gradients(mixer.chunk, x, h0, opts, do, dS, torch.float32)
    for n in plain:
        assert torch.equal(tuned[n], plain[n]), f"d{n} changed when staged_dk was autotuned"
