"""The table of elementwise primitives (lrdsl/primitives.py) through every stage: the parser and
the printer (round trip), the checker's range rules (against sampled values), the reference
(float64, against mpmath), and the recurrent and chunked kernels with their gradients (against the
float64 reference, the tolerances of tests/test_recurrent.py: rms ratio < 1e-4, gradients of
inputs other than q, k, v < 1e-3), each primitive in a small spec of its own.
"""
from __future__ import annotations

import math
import random
import re

import mpmath
import numpy as np
import pytest
import sympy as sp
import torch

import lrdsl
from lrdsl.checks.checker import check
from lrdsl.checks.ranges import Ranges
from lrdsl.errors import SpecError
from lrdsl.frontend import primitives, printer, spec_to_ir
from lrdsl.testing import Case, check_case

# each primitive in a staged spec (scalar decay, erase key = write key: the generated chain rule)
# in the log decay, the gain and the write value; b, c in (0, 1), a, x, y unbounded, w a [V] gate
DECLS = {"a": "a", "x": "x", "y": "y", "b": "b in (0, 1)", "c": "c in (0, 1)", "w": "w[V]"}
SPECS = {
    # a log decay: Mamba's -exp(A) softplus(x + dt), with large arguments (|30 x| up to ~100)
    "softplus": ("let g = -exp(a) * softplus(30*x + y)", "let beta = 1 - exp(-softplus(b - x))", "w*v"),
    "log1p": ("let g = -log1p(exp(a))", "let beta = log1p(b)", "log1p(b*w*w)*v"),
    "tanh": ("let g = -exp(a)", "let beta = tanh(b + c)", "tanh(10*w)*v"),
    "silu": ("let g = -exp(silu(a))", "let beta = silu(b)", "silu(w)*v"),
    "max": ("let g = -max(exp(a), exp(x))", "let beta = max(b, c)", "max(w, 0.5*w)*v"),
    "min": ("let g = min(-exp(a), -exp(x), -0.5)", "let beta = min(b, c, 0.8)", "min(w, 1)*v"),
    "clamp": ("let g = -exp(clamp(a, -1, 1))", "let beta = clamp(x, 0, 1)", "clamp(w, -0.5, 0.5)*v"),
}


def spec(name: str) -> str:
    g, beta, value = SPECS[name]
    used = [d for n, d in DECLS.items() if re.search(rf"\b{n}\b", g + beta + value)]
    return (f"mixer p_{name}\ninput q[K] l2norm, k[K] l2norm, v[V], {', '.join(used)}\n{g}\n{beta}\n"
            f"S = (I - beta k k^T) exp(g) S + beta k ({value})^T\no = S^T q\n")


# a per-key-channel decay: the general kernels and PyTorch's chain rule (through the reference)
DIAGONAL = """mixer p_diag
input q[K] l2norm, k[K] l2norm, v[V], a[K], x[K], dt, b
let g = -exp(a) * softplus(x + dt)
let beta = clamp(tanh(b) + silu(b), 0, 1)
S = (I - beta k k^T) diag(exp(g)) S + beta k v^T
o = S^T q
"""

CASE = Case(B=1, T=37, H=1, HV=2, K=16, V=12, initial_state=True, scale=0.7, seed=3)


def test_every_primitive_has_a_spec_here():
    assert set(SPECS) | {"exp", "log", "sqrt", "abs", "sigmoid", "squash"} == set(primitives.NAMES)


@pytest.mark.parametrize("name", list(SPECS))
def test_printer_round_trip(name):
    m = spec_to_ir(spec(name))
    text = printer.explicit(m)
    assert spec_to_ir(text) == m
    assert name in text or name == "clamp"  # clamp(x, lo, hi) prints as min(max(x, lo), hi)


# softplus runs in pytest -q through gated_deltanet_gates' kernels, max through clamp: both under -m slow here
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("softplus", "max") else n
                                  for n in SPECS])
def test_kernels_and_gradients_match_the_reference(name):
    mixer = lrdsl.compile(text=spec(name))
    assert mixer.kernels.HAS_CHAIN_RULE  # the generated chain rule, with the table's derivatives
    out = check_case(mixer, CASE, impls=("recurrent", "chunk"), grad=True)
    assert not out.message, out.message
    assert set(out.grad_errors) >= {i.name for i in mixer.ir.inputs}


def test_diagonal_decay_kernels_and_gradients_match_the_reference():
    mixer = lrdsl.compile(text=DIAGONAL)
    out = check_case(mixer, CASE, impls=("recurrent", "chunk"), grad=True)
    assert not out.message, out.message


def test_checker_proves_the_softplus_log_decay():
    m = spec_to_ir(DIAGONAL)
    rg = Ranges(m)
    assert rg.of(m.inline_lets(sp.Symbol("g", real=True)))[1] <= 0
    facts = check(m)
    assert facts["stable"] is True


# ---- values: the reference's torch functions and the range rules ---------------------------------
MP = {"softplus": lambda x: mpmath.log1p(mpmath.exp(x)), "log1p": mpmath.log1p, "tanh": mpmath.tanh,
      "silu": lambda x: x / (1 + mpmath.exp(-x))}
POINTS = [-800.0, -60.0, -20.0, -1.2784645, -1e-9, 0.0, 3e-8, 0.5, 20.0, 60.0, 800.0]


@pytest.mark.parametrize("name", list(MP))
def test_reference_functions_are_exact_in_float64(name):
    for x in POINTS:
        if name == "log1p" and x <= -1:
            continue
        got = primitives.BY_NAME[name].torch(torch.tensor(x, dtype=torch.float64)).item()
        want = float(MP[name](mpmath.mpf(x)))
        assert math.isfinite(got) and abs(got - want) <= 1e-15 * max(abs(want), 1e-300), (x, got, want)


# sampled intervals: the first 60 in pytest -q, all 300 (the same 60 first) under -m slow
@pytest.mark.parametrize("intervals", [60, pytest.param(300, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", list(MP) + ["exp", "log", "abs", "max", "min"])
def test_range_rules_enclose_sampled_values(name, intervals):
    prim = primitives.BY_NAME[name]
    rng = random.Random(0)
    n = 2 if prim.arity == 0 else 1
    for _ in range(intervals):
        ivs = [sorted(rng.choice([rng.uniform(-5, 5), rng.uniform(-100, 100), 0.0]) for _ in range(2))
               for _ in range(n)]
        if name in ("log", "log1p"):
            ivs = [[max(lo, 1e-6 - (name == "log1p")), max(hi, 1e-6 - (name == "log1p"))] for lo, hi in ivs]
        lo, hi = prim.range(*map(tuple, ivs))
        for _ in range(20):
            xs = [rng.uniform(*iv) for iv in ivs]
            v = float(prim.form(*map(sp.Float, xs)))
            assert lo - 1e-12 * (1 + abs(lo)) <= v <= hi + 1e-12 * (1 + abs(hi)), (ivs, xs, v, (lo, hi))


def test_range_rules_are_exact_at_the_ends():
    r = lambda name, *a: primitives.BY_NAME[name].range(*a)  # noqa: E731
    assert r("softplus", (-math.inf, math.inf)) == (0.0, math.inf)
    assert r("tanh", (-math.inf, math.inf)) == (-1.0, 1.0)
    assert r("silu", (-math.inf, math.inf)) == (pytest.approx(-0.278464542761074), math.inf)
    assert r("silu", (-math.inf, -2.0)) == (pytest.approx(-2 / (1 + math.exp(2))), 0.0)
    assert r("log1p", (0.0, math.inf)) == (0.0, math.inf)


# ---- errors --------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("let beta = clamp(b, 0)", "clamp(...) takes 3 arguments, got 2; write clamp(x, lo, hi)"),
    ("let beta = max(b)", "max(...) takes two or more arguments, got 1; write max(x, y, ...)"),
    ("let beta = softplus(b, c)", "softplus(...) takes one argument, got 2; write softplus(x)"),
    ("let beta = max(b, v)", "cannot take max(...) of a [K] vector and a [V] vector"),
    ("let softplus = b", "'softplus' is reserved"),
])
def test_user_mistakes_are_one_clear_sentence(text, message):
    body = "mixer m\ninput q[K] l2norm, k[K] l2norm, v[V], b[K]\n" + text + "\nS = S + k v^T\no = S^T q\n"
    with pytest.raises(SpecError) as e:
        spec_to_ir(body)
    assert message in str(e.value) and str(e.value).startswith("<spec>:3:")


def test_triton_text_is_stable_for_large_arguments():
    """The table's Triton texts evaluated in float32 with numpy standing in for tl."""
    class TL:
        exp, log, abs, maximum, minimum = np.exp, np.log, np.abs, np.maximum, np.minimum

        @staticmethod
        def where(c, a, b):
            return np.where(c, a, b)

    x = np.array([-100.0, -30.0, -1e-6, 0.0, 1e-6, 0.3, 30.0, 100.0], dtype=np.float32)
    with np.errstate(all="ignore"):
        for name in MP:
            got = eval(primitives.BY_NAME[name].triton("x"), {"tl": TL, "x": x})  # noqa: S307
            want = np.array([float(MP[name](mpmath.mpf(float(v)))) if name != "log1p" or v > -1 else np.nan
                             for v in x])
            ok = ~np.isnan(want)
            assert np.allclose(got[ok], want[ok], rtol=3e-6, atol=1e-30), (name, got, want)
