"""The checker's own interval ranging (lrdsl/checks/ranges.py) against mpmath.iv, and its witness search
(lrdsl/checks/witness.py) against scipy.optimize.differential_evolution, on the examples and the checker
tests' specs (tests/test_checker.py SPECS). Needs mpmath (sympy's dependency) and scipy (not a dependency).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/checker_libs.py

Intervals: every let, decay and erase factor (lets inlined) is ranged by both over the declared input
ranges; the true range is estimated from inside by 20000 random admissible points (box() of
witness.py, far points included). Tightness compares the widths of the two enclosures; an aux state's
symbol takes ranges.py's range in both (mpmath has no recurrences).
Witnesses: for each (spec, quantity) the checker searches (the spectral norm, the spectral radius, a
negative eigenvalue; one step), ours and differential evolution look at K = 2, 3, 4 in turn for a
replayed witness above the checker's threshold; DE gets a budget of about ours (40 generations of
15 x dims candidates), a prefix equal to the step's token, and stops early once over the threshold.
"""
from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

import mpmath
import numpy as np
import sympy as sp
from scipy.optimize import differential_evolution

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_checker import SPECS  # noqa: E402

from lrdsl.checks import witness  # noqa: E402
from lrdsl.checks.ranges import INF, Ranges  # noqa: E402
from lrdsl.frontend import primitives, spec_to_ir  # noqa: E402

iv = mpmath.iv
warnings.filterwarnings("ignore")


def _ivmax(*xs):
    return iv.mpf([max(x.a for x in xs), max(x.b for x in xs)])


def _ivmin(*xs):
    return iv.mpf([min(x.a for x in xs), min(x.b for x in xs)])


def _ivtanh(x):
    e = iv.exp(2 * x)
    return (e - 1) / (e + 1)


# the spec language's functions in mpmath's interval arithmetic, written from their definitions
IV = {"exp": iv.exp, "log": iv.log, "sqrt": iv.sqrt, "Abs": lambda x: iv.mpf([0 if x.a <= 0 <= x.b else
                                                                              min(abs(x.a), abs(x.b)),
                                                                              max(abs(x.a), abs(x.b))]),
      "softplus": lambda x: iv.log(1 + iv.exp(x)), "log1p": lambda x: iv.log(1 + x), "tanh": _ivtanh,
      "silu": lambda x: x / (1 + iv.exp(-x)), "Max": _ivmax, "Min": _ivmin, "E": iv.e, "pi": iv.pi}


def _iv_of(e, syms, values):
    f = sp.lambdify(syms, primitives.expanded(e), [IV, "mpmath"])
    r = f(*values)
    r = r if isinstance(r, type(iv.mpf(0))) else iv.mpf(r)
    return float(r.a), float(r.b)


def _sampled(e, m, syms, n=20000, seed=0):
    rng = np.random.default_rng(seed)
    f = sp.lambdify(syms, primitives.expanded(e), [primitives.NUMPY, "numpy"])
    rg, cols = Ranges(m), []
    for s in syms:
        inp = next((i for i in (*m.inputs, *m.params) if i.symbol == s), None)
        if inp is None:  # h or an aux state: uniform over ranges.py's range, clipped
            lo, hi = rg.sym(s)
            lo, hi = max(lo, -1e3), min(hi, 1e3)
            cols.append(rng.uniform(lo, hi, n))
            continue
        lo, hi, points = witness.box(inp)
        x = rng.uniform(lo, hi, n)
        cols.append(np.where(rng.random(n) < 0.3, rng.choice(points, n), x))
    with np.errstate(all="ignore"):
        v = np.broadcast_to(np.asarray(f(*cols), dtype=float), (n,))
    v = v[np.isfinite(v)]
    return (float(v.min()), float(v.max())) if len(v) else None


def _width(r):
    return r[1] - r[0]


def specs():
    out = {p.stem: p.read_text() for p in sorted((ROOT / "examples").glob("*.lr"))}
    out.update({f"test:{k}": v for k, v in SPECS.items()})
    return out


def intervals(table):
    tally = {"ours tighter": 0, "equal": 0, "mpmath.iv tighter": 0, "ours unsound": 0, "iv unsound": 0}
    t_ours = t_iv = 0.0
    n = 0
    for name, text in table.items():
        m = spec_to_ir(text)
        parts = [(f"let {lt.name}", lt.expr) for lt in m.lets] + [("decay", m.decay.value)]
        parts += [("a", m.delta.a), ("c", m.delta.c)] if m.delta else []
        rg = Ranges(m)
        for label, e in parts:
            e = m.inline_lets(e)
            syms = sorted(sp.sympify(e).free_symbols, key=str)
            if not syms:
                continue
            t0 = time.perf_counter()
            ours = Ranges(m).of(e)
            t_ours += time.perf_counter() - t0
            vals = []
            for s in syms:
                inp = next((i for i in (*m.inputs, *m.params) if i.symbol == s), None)
                lo, hi = (float(inp.lo), float(inp.hi)) if inp is not None else rg.sym(s)
                vals.append(iv.mpf([lo if lo > -INF else "-inf", hi if hi < INF else "inf"]))
            t0 = time.perf_counter()
            try:
                theirs = _iv_of(e, syms, vals)
            except Exception as err:  # noqa: BLE001 - a function mpmath.iv lacks
                theirs = (-INF, INF)
                print(f"  {name} {label}: mpmath.iv failed ({type(err).__name__})")
            t_iv += time.perf_counter() - t0
            seen = _sampled(e, m, syms)
            n += 1
            wo, wt = _width(ours), _width(theirs)
            same = wo == wt or (math.isfinite(wo) and math.isfinite(wt) and abs(wo - wt) <= 1e-9 * max(1, wo))
            tally["equal" if same else "ours tighter" if wo < wt else "mpmath.iv tighter"] += 1
            if seen and not (ours[0] <= seen[0] + 1e-9 and seen[1] <= ours[1] + 1e-9):
                tally["ours unsound"] += 1
            if seen and not (theirs[0] <= seen[0] + 1e-9 and seen[1] <= theirs[1] + 1e-9):
                tally["iv unsound"] += 1
            if not same:
                print(f"  {name:28s} {label:10s} ours [{ours[0]:.4g}, {ours[1]:.4g}]  iv [{theirs[0]:.4g}, "
                      f"{theirs[1]:.4g}]  sampled [{seen[0]:.4g}, {seen[1]:.4g}]" if seen else "")
    print(f"intervals: {n} expressions over {len(table)} specs: {tally}")
    print(f"  time: ours {t_ours:.2f} s (exact calculus and monotone corners included), "
          f"mpmath.iv {t_iv:.2f} s (lambdify included)")


def de_search(num, kind, threshold, Ks=(2, 3, 4), seed=0):
    """differential_evolution over one token (and the prefix length, the head index), maximising
    witness.py's quantity; the best candidate replayed as witness.py replays its own."""
    evals = 0
    for K in Ks:
        layout, bounds = [], []
        for i in num.inputs:
            w = K if witness._vector(i) else 1
            lo, hi, points = witness.box(i)
            b = (-1.0, 1.0) if i.unit and witness._vector(i) else (min(points), max(points))
            layout.append((i, w))
            bounds += [b] * w
        if num.aux:
            bounds.append((0, len(witness.PREFIXES) - 1e-9))
        if num.uses_h:
            bounds.append((0, 8 - 1e-9))

        def seqs(X):
            n, col, tok = len(X), 0, {}
            for i, w in layout:
                v = X[:, col:col + w]
                if i.unit and witness._vector(i):
                    v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-300)
                tok[i.name], col = v, col + w
            reps = witness.PREFIXES[X[:, col].astype(int)] if num.aux else np.zeros(n, dtype=int)
            h = np.floor(X[:, -1:]) if num.uses_h else np.zeros((n, 1))
            return witness._tie(num, witness.Seqs(h, reps, tok, (tok,)))

        def f(XT):
            nonlocal evals
            X = np.atleast_2d(XT.T)
            evals += len(X)
            sc = witness._scores(num, seqs(X), K, kind, (0,))
            return -np.nan_to_num(sc, nan=-1e300, posinf=1e300, neginf=-1e300)

        if not bounds:  # the transition reads no input: one evaluation says it all
            x = np.zeros(0)
            if -f(x[:, None])[0] > threshold:
                w = witness._witness(num, seqs(x[None, :]), K, kind, threshold, 1)
                if w is not None:
                    return w, evals
            continue
        res = differential_evolution(f, bounds, vectorized=True, updating="deferred", seed=seed, maxiter=40,
                                     popsize=15, polish=False, tol=0,
                                     callback=lambda intermediate_result: -intermediate_result.fun > threshold)
        if -res.fun > threshold:
            w = witness._witness(num, seqs(res.x[None, :]), K, kind, threshold, 1)
            if w is not None:
                return w, evals
    return None, evals


THRESHOLD = {"norm": 1 + 1e-9, "radius": 1 + 1e-9, "negative": 1e-6}


def witnesses(table):
    rows, t_ours, t_de = [], 0.0, 0.0
    for name, text in table.items():
        m = spec_to_ir(text)
        num = witness.numeric(m)
        for kind, thr in THRESHOLD.items():
            t0 = time.perf_counter()
            ours = witness.search(num, kind, thr)
            t1 = time.perf_counter()
            de, evals = de_search(num, kind, thr)
            t2 = time.perf_counter()
            t_ours, t_de = t_ours + t1 - t0, t_de + t2 - t1
            rows.append((name, kind, ours is not None, de is not None, t1 - t0, t2 - t1, evals))
    both = sum(r[2] and r[3] for r in rows)
    only_ours = [(r[0], r[1]) for r in rows if r[2] and not r[3]]
    only_de = [(r[0], r[1]) for r in rows if r[3] and not r[2]]
    print(f"witnesses: {len(rows)} searches over {len(table)} specs; found by both {both}, ours only "
          f"{len(only_ours)} {only_ours}, differential evolution only {len(only_de)} {only_de}")
    print(f"  time: ours {t_ours:.1f} s, differential evolution {t_de:.1f} s "
          f"({sum(r[6] for r in rows)} evaluations)")


if __name__ == "__main__":
    table = specs()
    intervals(table)
    witnesses(table)
