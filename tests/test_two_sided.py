"""Two-sided transitions, S_t = M_t S_{t-1} N_t + u_t z_t^T with M_t [K, K] and N_t [V, V] each
diagonal plus rank 1 (issue 40 part 2), against the float64 reference: the reference against dense
matrices, recurrent and step (the generated token loop), and chunk forward and gradients (the token
loop's kernel and its backward kernel, tests/test_two_sided_bwd.py), with packed sequences, grouped
value heads and strong decays.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_backward import compare, describe, grad_cases
from test_dplr import against_reference, failing, reference64, tiered
from test_recurrent import DEVICE

import lrdsl
from lrdsl.errors import InputError, SpecError
from lrdsl.frontend import printer, spec_to_ir
from lrdsl.testing import TOL, Case, check_case, draw_inputs, rms_ratio

INPUTS = "input q[K], k[K] l2norm, v[V] l2norm, g[K] log, gv[V] log, beta in (0, 1)"
# name -> (M S N as written, M's order, N's order)
SPECS = {
    "kda_oja": ("(I - beta k k^T) diag(exp(g)) S diag(exp(gv)) (I - beta v v^T)", "left", "right"),
    "erase_then_decay": ("diag(exp(g)) (I - beta k k^T) S (I - beta v v^T) diag(exp(gv))", "right", "left"),
    "decays_only": ("diag(exp(g)) S diag(exp(gv))", None, None),
    "additive_n": ("diag(exp(g)) S (diag(exp(gv)) - (beta*v) v^T)", None, "sum"),
}


def spec_text(name: str) -> str:
    return f"mixer ts_{name}\n{INPUTS}\nS = {SPECS[name][0]} + beta k v^T\no = S^T q\n"


@pytest.fixture(scope="module")
def mixer():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = lrdsl.compile(text=spec_text(name))
        return cache[name]
    return get


def dense(name, x, t, h, K, V):
    """(M_t, N_t) of value head h by hand."""
    unit = lambda u: u * torch.rsqrt((u * u).sum() + 1e-6)
    k, v, b = unit(x["k"][0, t, 0]), unit(x["v"][0, t, h]), x["beta"][0, t, h]
    Dk, Dv = torch.diag(x["g"][0, t, h].exp()), torch.diag(x["gv"][0, t, h].exp())
    Ek = torch.eye(K, dtype=k.dtype) - b * torch.outer(k, k)
    Ev = torch.eye(V, dtype=v.dtype) - b * torch.outer(v, v)
    return {"kda_oja": (Ek @ Dk, Dv @ Ev), "erase_then_decay": (Dk @ Ek, Ev @ Dv),
            "decays_only": (Dk, Dv), "additive_n": (Dk, Dv - b * torch.outer(v, v))}[name]


@pytest.mark.parametrize("name", list(SPECS))
def test_reference_is_the_two_sided_transition(mixer, name):
    """The reference against S = M S N + beta k v^T over dense matrices; each side's recorded order."""
    m = mixer(name)
    assert m.ir.side == "both"
    orders = (m.ir.delta.order if m.ir.delta else None, m.ir.n_delta.order if m.ir.n_delta else None)
    assert orders == SPECS[name][1:]
    case = Case(B=1, T=9, H=1, HV=2, K=5, V=4, initial_state=True, seed=1)
    x, opts = draw_inputs(m, case)
    x = {n: t.double() for n, t in x.items()}
    S0 = opts["initial_state"].double()
    o, s = m.reference(**x, initial_state=S0, output_final_state=True)
    for h in range(2):
        S = S0[0, h]
        for t in range(case.T):
            M, N = dense(name, x, t, h, case.K, case.V)
            v = x["v"][0, t, h] * torch.rsqrt((x["v"][0, t, h] ** 2).sum() + 1e-6)
            k = x["k"][0, t, 0] * torch.rsqrt((x["k"][0, t, 0] ** 2).sum() + 1e-6)
            S = M @ S @ N + x["beta"][0, t, h] * torch.outer(k, v)
            assert torch.allclose(o[0, t, h], S.T @ (x["q"][0, t, 0] * case.K ** -0.5), rtol=1e-9, atol=1e-12)
        assert torch.allclose(s[0, h], S, rtol=1e-9, atol=1e-12)


CASES = {
    "B2-T37-HV2-h0": Case(B=2, T=37, H=1, HV=2, K=12, V=8, initial_state=True, scale=0.7, seed=1),
    "varlen-H2-HV4-h0": Case(B=1, T=37, H=2, HV=4, K=8, V=12, cu_seqlens=(0, 5, 5, 37), initial_state=True, seed=2),
}


@pytest.mark.parametrize("name, case_id", tiered([("kda_oja", "varlen-H2-HV4-h0"), ("erase_then_decay", "B2-T37-HV2-h0"),
                                                  ("decays_only", "varlen-H2-HV4-h0"), ("additive_n", "B2-T37-HV2-h0")],
                                                 [("kda_oja", "varlen-H2-HV4-h0")]))
def test_paths_match_the_reference(mixer, name, case_id):
    """recurrent and chunk forward, and chunk's gradient of every input and of the initial state."""
    out = check_case(mixer(name), CASES[case_id], DEVICE, impls=("recurrent", "chunk"), grad=True)
    assert out.ok, out.message


@pytest.mark.parametrize("which, value", tiered([(w, v) for w in ("g", "gv") for v in (-1e4, -float("inf"))],
                                                [("g", -float("inf")), ("gv", -1e4)]))
def test_strong_decays(mixer, which, value):
    """M's or N's log-decay at -1e4 or -inf on two single tokens and a whole 16-token block."""
    m = mixer("kda_oja")
    x, opts = draw_inputs(m, Case(B=1, T=40, H=1, HV=2, K=8, V=8, initial_state=True, seed=7), DEVICE)
    t = x[which].clone()
    t[:, (9, 30)] = value
    t[:, 16:32] = value
    bad = failing(against_reference(m, dict(x, **{which: t}), opts))
    assert not bad, bad


def test_step_matches_the_reference(mixer):
    m = mixer("kda_oja")
    x, opts = draw_inputs(m, Case(B=2, T=5, H=1, HV=2, K=8, V=8, initial_state=True, seed=3), DEVICE)
    state = opts["initial_state"].clone().contiguous()
    with torch.no_grad():
        outs = [m.step(**{n: t[:, i:i + 1] for n, t in x.items()}, state=state) for i in range(5)]
    ref_o, ref_s, _ = reference64(m, x, opts)
    assert rms_ratio(torch.cat(outs, 1), ref_o) < TOL and rms_ratio(state, ref_s) < TOL


@pytest.mark.parametrize("name", list(SPECS))
def test_printer_round_trip(mixer, name):
    m = mixer(name)
    assert spec_to_ir(printer.explicit(m.ir)) == m.ir
    assert "side    both" in printer.canonical(m.ir)


def test_checker_combines_m_and_n():
    """Both factors contractions: every fact proved, eigenvalues in [0, 1]. N's erase gain up to 3
    (eigenvalue 1 - 3 = -2): refused, naming N, unless `allow unstable` (then unknown, not proved)."""
    facts = lrdsl.compile(text=spec_text("kda_oja")).check()
    assert facts["facts"]["bounded_state"] == "proved" and facts["facts"]["stable"] == "proved"
    assert facts["eigenvalues"] == {"min": 0.0, "max": 1.0, "proved": True}
    text = spec_text("kda_oja").replace("(I - beta v v^T)", "(I - (3*beta) v v^T)")
    with pytest.raises(SpecError, match="in the two-sided M S N, N's eigenvalues"):
        lrdsl.compile(text=text)
    assert lrdsl.compile(text=text + "allow unstable\n").check()["facts"]["stable"] == "unknown"


def test_context_parallelism_refuses_clearly(mixer):
    m = mixer("kda_oja")
    x, _ = draw_inputs(m, Case(B=1, T=4, H=1, HV=1, K=4, V=4))
    with pytest.raises(InputError, match="context parallelism does not support"):
        m.chunk(**x, cp_group=object())


# ---- slow: random two-sided specs ------------------------------------------------------------------
M_FORMS = {"decay": "diag(exp(g))", "scalar": "exp(s)", "kda": "(I - beta k k^T) diag(exp(g))",
           "after": "diag(exp(g)) (I - beta k k^T)", "additive": "(diag(exp(g)) - (a*kk) kk^T)"}
N_FORMS = {"decay": "diag(exp(gv))", "oja": "diag(exp(gv)) (I - beta v v^T)",
           "before": "(I - beta v v^T) diag(exp(gv))", "additive": "(diag(exp(gv)) - (b*vv) vv^T)"}


def random_text(m_form: str, n_form: str) -> str:
    M, N = M_FORMS[m_form], N_FORMS[n_form]
    body = f"{M} S {N}"
    names = {"g": "g[K] log", "s": "s log", "gv": "gv[V] log", "beta": "beta in (0, 1)", "a": "a[K] in [0, 1]",
             "kk": "kk[K] l2norm", "b": "b[V] in [0, 1]", "vv": "vv[V] l2norm"}
    used = [d for n, d in names.items() if re.search(rf"\b{n}\b", body)]
    return (f"mixer ts_random\ninput q[K], k[K] l2norm, v[V] l2norm, {', '.join(used)}\nS = {body} + k v^T\n"
            "o = S^T q\nallow unstable\n")


@pytest.mark.slow
@settings(max_examples=12, deadline=None, database=None, derandomize=True,
          phases=(Phase.explicit, Phase.generate), suppress_health_check=[HealthCheck.too_slow])
@given(m_form=st.sampled_from(sorted(M_FORMS)), n_form=st.sampled_from(sorted(N_FORMS)), drawn=grad_cases())
def test_random_two_sided_specs_match_the_reference(m_form, n_form, drawn):
    """Every form of M beside every form of N on random shapes: recurrent's forward, and chunk's
    forward and every gradient, against the float64 reference."""
    text = random_text(m_form, n_form)
    case, output_final_state = drawn
    mixer = lrdsl.compile(text=text)
    assert mixer.ir.side == ("right" if m_form == "scalar" else "both")  # a number per head commutes: S N
    out = check_case(mixer, case, DEVICE, impls=("recurrent",))
    assert out.ok, f"{text}{case}: {out.message}"
    errors, failures = compare(mixer, case, output_final_state=output_final_state, seed=case.seed + 1)
    assert not failures, f"{text}{case}: failing {describe(failures)}"
