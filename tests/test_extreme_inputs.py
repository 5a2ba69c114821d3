"""Extreme but legal inputs: log-decays of -1e4, -1e8 and -inf (a hard reset) at single tokens.

The chunked kernels cumulate log-decays in fp32 within a chunk; without care one token at -1e8
swamps the differences of the tokens after it (rms error ~1 against the reference) and -inf turns
the rest of the sequence into nan. Forward and backward must match the float64 reference.
"""
import pytest
import torch
from test_recurrent import DEVICE, EXAMPLES, state_parts

from lrdsl.testing import TOL, Case, draw_inputs, rms_ratio

MIXERS = ["gated_deltanet", "mamba2", "gla", "kda", "precond_deltanet", "kda_decay_after_erase"]


def chunk_against_reference(mixer, x, opts):
    """rms ratios of chunk's o, final state and every input's gradient (loss (o * do).sum(), do
    random) against the float64 reference, and both sets of leaves."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, **opts)
    do = torch.randn_like(o)
    (o * do).sum().backward()
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = mixer.reference(**ref_leaves, **dict(opts, initial_state=opts["initial_state"].double()))
    (ref_o * do.double()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s)}
    errs.update({"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x})
    return errs, leaves, ref_leaves


# -inf (a hard reset) for every mixer and -1e8 for one scalar and one per-channel decay in pytest -q;
# -1e8 for the others (the same guards) and -1e4 under -m slow
SLOW = ({(-1e4, n) for n in MIXERS} | {(-1e8, n) for n in ("mamba2", "kda", "precond_deltanet", "kda_decay_after_erase")}
        | {(float("-inf"), n) for n in ("mamba2", "precond_deltanet")})


@pytest.mark.parametrize("name, value", [pytest.param(n, v, marks=pytest.mark.slow) if (v, n) in SLOW else (n, v)
                                         for n in MIXERS for v in (-1e4, -1e8, float("-inf"))],
                         ids=lambda x: {-1e4: "-1e4", -1e8: "-1e8"}.get(x, str(x)))
def test_strong_decay_at_one_token(name, value, compiled):
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    case = Case(B=1, T=100, H=2, HV=2, K=16, V=16, initial_state=True, seed=5)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x["g"][0, 30] = value  # inside the first chunk, and in the second of the 64-token chunks
    x["g"][0, 70] = value
    errs, _, _ = chunk_against_reference(mixer, x, opts)
    limit = {"o": TOL, "S": TOL, "dq": TOL, "dk": TOL, "dv": TOL}
    bad = {n: e for n, e in errs.items() if not e < limit.get(n, 10 * TOL)}
    assert not bad, f"{name} g={value}: {bad}"


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_a_run_of_tokens_below_the_log_decay_floor(name, compiled):
    """The chunked kernels count a per-token log-decay below -20 as -20 (plan.log_decay_floor). A
    run of 20 tokens at -25 each (across a chunk boundary) is then -400 where the reference has
    -500: both leave exp(-400) of the state, nothing in fp32, so forward and backward still match
    the float64 reference. (Where the floor is not exact: docs/kernels.md, "The log-decay floor".)"""
    mixer = compiled(next(p for p in EXAMPLES if p.stem == name))
    case = Case(B=1, T=100, H=2, HV=2, K=16, V=16, initial_state=True, seed=8)
    x, opts = draw_inputs(mixer, case, DEVICE)
    x["g"][0, 50:70] = -25.0
    errs, leaves, ref_leaves = chunk_against_reference(mixer, x, opts)
    del errs["dg"]  # below: the kernels' is zero at the floored tokens
    limit = {"o": TOL, "S": TOL, "dq": TOL, "dk": TOL, "dv": TOL}
    bad = {n: e for n, e in errs.items() if not e < limit.get(n, 10 * TOL)}
    assert not bad, f"{name}: {bad}"
    # g's gradient is the reference's but at the floored tokens, where the kernels' is zero (the
    # floor is flat there) and the reference's is not
    kept = torch.ones_like(x["g"], dtype=torch.bool)
    kept[0, 50:70] = False
    assert rms_ratio(leaves["g"].grad[kept], ref_leaves["g"].grad[kept]) < 10 * TOL
    assert leaves["g"].grad[~kept].abs().max() == 0


@pytest.mark.parametrize("name", ["gated_deltanet", pytest.param("gdn2", marks=pytest.mark.slow),
                                  pytest.param("precond_deltanet", marks=pytest.mark.slow)])
def test_out_of_range_inputs_are_clamped_the_same_on_every_path(name, compiled):
    """A value outside its declared range (g > 0 for a `log` input, beta > 1 for beta in (0, 1))
    is clamped into the range by the reference, the recurrent and the chunked kernels alike (with
    the reference's range assertion off: it is on by default)."""
    from lrdsl.errors import InputError
    path = next(p for p in EXAMPLES if p.stem == name)
    mixer = compiled(path, check_ranges=False)
    case = Case(B=1, T=70, H=1, HV=2, K=16, V=16, initial_state=True, seed=6)
    x, opts = draw_inputs(mixer, case, DEVICE)
    wild, clamped = dict(x), dict(x)
    for i in mixer.ir.inputs:
        if i.log or (i.lo == 0 and i.hi == 1):
            t = x[i.name].clone()
            t.view(-1)[::7] = 0.5 if i.log else 1.3  # every 7th value out of range
            wild[i.name] = t
            clamped[i.name] = t.clamp(max=0.0) if i.log else t.clamp(0.0, 1.0)
    with pytest.raises(InputError, match="outside its declared range"):
        compiled(path).reference(**wild, **opts)
    ref_wild = mixer.reference(**wild, **opts)
    ref_clamped = mixer.reference(**clamped, **opts)
    assert torch.equal(ref_wild[0], ref_clamped[0])
    assert all(torch.equal(a, b) for a, b in zip(state_parts(ref_wild[1]).values(), state_parts(ref_clamped[1]).values()))
    ref_o, ref_s = mixer.reference(**{n: t.double() for n, t in wild.items()},
                                   **dict(opts, initial_state=opts["initial_state"].double()))
    with torch.no_grad():
        for path in ("chunk", "recurrent"):
            o, s = getattr(mixer, path)(**wild, **opts)
            assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL, path


def test_check_ranges_refuses_out_of_range_inputs():
    import lrdsl
    from lrdsl.errors import InputError
    path = next(p for p in EXAMPLES if p.stem == "gated_deltanet")
    strict = lrdsl.compile(path, check_ranges=True)
    x, opts = draw_inputs(strict, Case(B=1, T=20, H=1, HV=1, K=16, V=16, seed=7), DEVICE)
    with torch.no_grad():
        strict.reference(**x, **opts)  # inside: fine
        x["beta"][0, 3] = 1.5
        for path_name in ("reference", "chunk", "recurrent"):
            with pytest.raises(InputError, match="beta"):
                getattr(strict, path_name)(**x, **opts)
        # by default only the reference asserts; check_ranges=False: nothing does
        default, off = lrdsl.compile(path), lrdsl.compile(path, check_ranges=False)
        with pytest.raises(InputError, match="beta"):
            default.reference(**x, **opts)
        for mixer, paths in ((default, ("chunk", "recurrent")), (off, ("reference", "chunk", "recurrent"))):
            for path_name in paths:
                assert torch.isfinite(getattr(mixer, path_name)(**x, **opts)[0]).all()


# Each family with a constant factor per head in front of its transition (RetNet's 1 - 2^(-5 - h)).
# Read as D (I - a c^T) with a = beta k exp(-g), c = k exp(g), a decay per key channel computes
# exp(-g) = inf at g = -120 and gives nan on every path; the canonical reading keeps the constant in D.
CONST = "(1 - 2^(-5 - h))"
CONSTANT_IN_FRONT = {
    "deltanet": ("input q[K] l2norm, k[K] l2norm, v[V], beta in (0, 1)", "(I - beta k k^T)", "beta k v^T"),
    "gated_deltanet": ("input q[K] l2norm, k[K] l2norm, v[V], g log, beta in (0, 1)",
                       "(I - beta k k^T) exp(g)", "beta k v^T"),
    "kda": ("input q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 1)",
            "(I - beta k k^T) diag(exp(g))", "beta k v^T"),
    "gla": ("input q[K] l2norm, k[K] l2norm, v[V], g[K] log", "diag(exp(g))", "k v^T"),
    "gdn2": ("input q[K] l2norm, k[K] l2norm, v[V], g[K] log, b[K] in [0, 1], w[V] in [0, 1]",
             "(I - k (b*k)^T) diag(exp(g))", "k (w*v)^T"),
}


@pytest.mark.parametrize("name", [n if n in ("gated_deltanet", "kda") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CONSTANT_IN_FRONT])
def test_a_constant_in_front_of_the_transition_keeps_strong_decays_finite(name):
    """One token at g = -120 (exp(g) = 0 in fp32, exp(-g) = inf) with a constant in front of the
    transition: chunk, recurrent and the chunk gradients against the float64 reference."""
    import lrdsl
    inputs, transition, write = CONSTANT_IN_FRONT[name]
    mixer = lrdsl.compile(text=f"mixer {name}_c\n{inputs}\nS = {CONST} {transition} S + {write}\no = S^T q\n")
    case = Case(B=1, T=24, H=1, HV=2, K=16, V=16, initial_state=True, seed=8)
    x, opts = draw_inputs(mixer, case, DEVICE)
    if "g" in x:
        x["g"][0, 9] = -120.0
    ref_leaves = {n: t.double().requires_grad_() for n, t in x.items()}
    ref_o, ref_s = mixer.reference(**ref_leaves, **dict(opts, initial_state=opts["initial_state"].double()))
    do = torch.randn_like(ref_o)
    (ref_o * do).sum().backward()
    with torch.no_grad():
        o, s = mixer.recurrent(**x, **opts)
    assert rms_ratio(o, ref_o) < TOL and rms_ratio(s, ref_s) < TOL, "recurrent"
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, s = mixer.chunk(**leaves, **opts)
    (o * do.float()).sum().backward()
    errs = {"o": rms_ratio(o, ref_o), "S": rms_ratio(s, ref_s)}
    errs.update({"d" + n: rms_ratio(leaves[n].grad, ref_leaves[n].grad) for n in x})
    bad = {n: e for n, e in errs.items() if not e < (TOL if n in ("o", "S", "dq", "dk", "dv") else 10 * TOL)}
    assert not bad, f"chunk: {bad}"


def test_a_transition_that_would_need_the_inverse_decay_keeps_its_additive_form(tmp_path):
    """M = D - beta k k^T with D per key channel is (I - a c^T) D only with c = k exp(-g), and
    D (I - a c^T) only with a = beta k exp(-g): both divide by the decay, so the lowering keeps M as
    written, D - a c^T (order "sum"), whose a and c hold no exp(-g); `lrdsl check` proves it stable."""
    import subprocess
    import sys

    import sympy as sp

    from lrdsl.frontend import spec_to_ir
    text = ("mixer m\ninput q[K] l2norm, k[K] l2norm, v[V], g[K] log, beta in (0, 1)\n"
            "S = diag(exp(g)) S - beta k k^T S + beta k v^T\no = S^T q\n")
    m = spec_to_ir(text)
    assert m.delta.order == "sum"
    g = sp.Symbol("g", real=True)
    for x in (m.delta.a, m.delta.c):
        assert g not in x.free_symbols, x
    path = tmp_path / "m.lr"
    path.write_text(text)
    run = subprocess.run([sys.executable, "-m", "lrdsl.cli", "check", str(path)], capture_output=True, text=True)
    assert run.returncode == 0 and "M = D - a c^T" in run.stdout, run.stdout + run.stderr
    assert "stable                proved" in run.stdout
