"""Ranges in several inputs (lrdsl/ranges.py): monotonicity in each input from the sign of the
partial derivatives over the box, the corners, interval arithmetic for the rest. Every range must
enclose sampled values; the ones marked exact must also be reached by them (up to sampling)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import sympy as sp

from lrdsl.checks.checker import check
from lrdsl.checks.ranges import Ranges
from lrdsl.frontend import ir, spec_to_ir

INPUTS = "input q[K], k[K] l2norm, v[V], b in (0, 1), c in (0, 1), a, x, dt in (-1, 1), y in [-2, 3]"
BOX = {"b": (0, 1), "c": (0, 1), "a": (-6, 6), "x": (-30, 30), "dt": (-1, 1), "y": (-2, 3)}
# (expression, its exact range, or None where only an enclosure is claimed)
CASES = [
    ("b*c/(b + c)", (0, 0.5)),
    ("2*b*c/(b + c)", (0, 1)),
    ("b/(b + c + 1)", (0, 0.5)),
    ("1 - (1 - b)*(1 - c)", (0, 1)),
    ("b*c - b*c^2", (0, 0.25)),  # monotone in b only: c (1 - c) on the face b = 1
    ("(b - c)/(1 + b*c)", (-1, 1)),
    ("y*b/(1 + c)", (-2, 3)),
    ("-exp(a)*softplus(x + dt)", (-math.inf, 0)),
    ("tanh(x)*sigmoid(dt)", (-1 / (1 + math.exp(-1)), 1 / (1 + math.exp(-1)))),
    ("max(b, c)*min(b, c)", (0, 1)),
    ("clamp(y, b, c + 1)", (0, 2)),
    ("silu(y) + log1p(b*c)", (-0.278464542761074, 3 / (1 + math.exp(-3)) + math.log(2))),
    ("(b - c)^2 + x*b", None),
    ("b/y", (-math.inf, math.inf)),  # d/dy = -b/y^2 <= 0, but y crosses the pole: no corners
]


def ranged(text):
    m = spec_to_ir(f"mixer m\n{INPUTS}\nlet r = {text}\nS = S + k v^T\no = S^T q\n")
    return Ranges(m).of(m.inline_lets(ir.symbol("r"))), m


def sample(m, n=20000, seed=0):
    """The let r at random points of the box, with a quarter of each input at its ends."""
    rng = np.random.default_rng(seed)
    env = {}
    for name, (lo, hi) in BOX.items():
        x = rng.uniform(lo, hi, n)
        ends = rng.random(n) < 0.25
        env[name] = np.where(ends, rng.choice([lo + 1e-9 * (hi - lo), hi - 1e-9 * (hi - lo)], n), x)
    e = m.inline_lets(ir.symbol("r"))
    from lrdsl.frontend import primitives
    f = sp.lambdify([ir.symbol(k) for k in env], primitives.expanded(e), [primitives.NUMPY, "numpy"])
    with np.errstate(all="ignore"):
        return np.broadcast_to(f(*env.values()), (n,))


@pytest.mark.parametrize("text, exact", CASES, ids=[c[0] for c in CASES])
def test_ranges_enclose_sampled_values_and_are_exact_where_claimed(text, exact):
    (lo, hi), m = ranged(text)
    v = sample(m)
    v = v[np.isfinite(v)]
    slack = 1e-9 * (1 + np.abs(v))
    assert (v >= lo - slack).all() and (v <= hi + slack).all(), (text, (lo, hi), v.min(), v.max())
    if exact is not None:
        assert (lo, hi) == (pytest.approx(exact[0], abs=1e-9), pytest.approx(exact[1], abs=1e-9))
        if math.isfinite(lo):
            assert v.min() <= lo + 0.02 * (hi - lo if math.isfinite(hi) else 1)


def test_a_gain_in_two_inputs_is_accepted_with_its_true_eigenvalues():
    """2 b c / (b + c) lies in (0, 1): interval arithmetic alone gives (0, inf) and refuses it."""
    m = spec_to_ir("mixer m\ninput q[K], k[K] l2norm, v[V], b in (0, 1), c in (0, 1)\n"
                   "let beta = 2*b*c/(b + c)\nS = (I - beta k k^T) S + beta k v^T\no = S^T q\n")
    facts = check(m)
    assert facts["stable"] is True and facts["facts"]["negative_eigenvalues"] == "disproved"
    assert facts["eigenvalues"]["min"] == pytest.approx(0.0, abs=1e-12)


def test_a_softplus_log_decay_is_proved_to_decay():
    m = spec_to_ir("mixer m\ninput q[K], k[K] l2norm, v[V], A[K], x[K], dt\n"
                   "let g = -exp(A) * softplus(x + dt)\nS = diag(exp(g)) S + k v^T\no = S^T q\n")
    facts = check(m)
    assert facts["stable"] is True and facts["eigenvalues"]["max"] <= 1.0
