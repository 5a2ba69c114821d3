"""Stability facts about a mixer's transition M = (I - a c^T) D (or D (I - a c^T)).

Two questions, answered separately because they differ for non-normal M:
- where do the eigenvalues lie (proved symbolically with interval arithmetic over the IR), and
- is ||M||_2 <= 1 (proved for diagonal and symmetric transitions, else searched numerically for a
  concrete counterexample; an eigenvalue bound alone does not bound the state's growth).
"""
from __future__ import annotations

import math

import numpy as np
import sympy as sp

from . import ir, printer
from .symbolic import MAX_SIMPLIFY_NESTING, nesting, simplified

INF = float("inf")
FULL = (-INF, INF)
TOL = 1e-12  # float rounding slack when comparing a proved interval with [-1, 1]


# ---- interval arithmetic over sympy expressions ------------------------------------------------
def _xm(x, y):
    # 0 * inf = 0: a zero endpoint is attained while an infinite one is only approached
    return 0.0 if x == 0 or y == 0 else x * y


def _mul(a, b):
    ps = [_xm(x, y) for x in a for y in b]
    return min(ps), max(ps)


def _recip(a):
    lo, hi = a
    if lo < 0 < hi or lo == hi == 0:
        return FULL
    return (1 / hi if hi else -INF), (1 / lo if lo else INF)


def _p(x, n):  # x ** n for x >= 0, with the limits at 0 and inf
    return (INF if n < 0 else 0.0 if n > 0 else 1.0) if x == 0 else \
        (INF if n > 0 else 0.0 if n < 0 else 1.0) if x == INF else x ** n


def _pow(b, n):
    lo, hi = b
    if n == int(n) and n < 0:
        return _recip(_pow(b, -n))
    if n == int(n):
        if n % 2 == 0 and lo < 0 < hi:
            return 0.0, max(_p(-lo, n), _p(hi, n))
        ends = [_p(abs(x), n) * (-1 if x < 0 and n % 2 else 1) for x in (lo, hi)]
        return min(ends), max(ends)
    if hi < 0:  # a fractional power is only real on x >= 0
        return FULL
    ends = [_p(max(lo, 0.0), n), _p(hi, n)]
    return min(ends), max(ends)


def _exp(a):
    return tuple(math.exp(x) if x < 700 else INF for x in a)


class Ranges:
    """Interval of any per-token expression, from the declared input ranges and inferred states."""

    def __init__(self, mixer: ir.Mixer):
        self.inputs = {i.symbol: i for i in mixer.inputs}
        self.aux = {ir.symbol(a.name): a for a in mixer.aux}
        self.lets = {ir.symbol(l.name): l for l in mixer.lets}
        self.memo = {}

    def sym(self, s):
        if s not in self.memo:
            self.memo[s] = FULL  # a state defined through itself gets no bound
            i = self.inputs.get(s)
            self.memo[s] = ((0.0, INF) if s == ir.HEAD else (float(i.lo), float(i.hi)) if i else
                            self.aux_range(self.aux[s]) if s in self.aux else
                            self.of(self.lets[s].expr) if s in self.lets else FULL)
        return self.memo[s]

    def aux_range(self, aux):
        # P_t = sum_j (decay products) write_j with P_0 = 0: a geometric bound on the total weight
        (dl, dh), (wl, wh) = self.of(aux.decay), self.of(aux.write)
        if dl >= 0 and dh <= 1:
            total = 1 / (1 - dh) if dh < 1 else INF
            return min(0.0, _xm(wl, total)), max(0.0, _xm(wh, total))
        if dl >= -1 and dh <= 1:
            top = _xm(max(-wl, wh), 1 / (1 - max(-dl, dh)) if max(-dl, dh) < 1 else INF)
            return -top, top
        return FULL

    def exact(self, e):
        """The exact range of an expression in one declared input (sigmoid(b), b/(1+b), 4b(1-b)),
        by sympy's calculus, which interval arithmetic overestimates (it forgets that the two b
        of b/(1+b) are one); None where it does not apply or sympy gives no interval."""
        syms = e.free_symbols
        x = next(iter(syms)) if len(syms) == 1 else None
        i = self.inputs.get(x)
        if i is None or nesting(e) > MAX_SIMPLIFY_NESTING or sp.count_ops(e) > 40:
            return None
        from sympy.calculus.util import function_range
        try:
            r = function_range(e, x, sp.Interval(i.lo, i.hi, i.lo_open, i.hi_open))
        except Exception:  # sympy could not decide (NotImplementedError and kin): fall back
            return None
        if not isinstance(r, sp.Interval) or not (r.inf.is_real and r.sup.is_real):
            return None
        return float(r.inf), float(r.sup)

    def of(self, e) -> tuple:
        if not e.is_number and not e.is_Symbol:
            r = self.exact(e)
            if r is not None:
                return r
        if e.is_number:
            v = complex(e)
            return (v.real, v.real) if v.imag == 0 else FULL
        if e.is_Symbol:
            return self.sym(e)
        if e.is_Add:
            los, his = zip(*(self.of(t) for t in e.args))
            r = sum(los), sum(his)
            return FULL if any(map(math.isnan, r)) else r
        if e.is_Mul:
            r = (1.0, 1.0)
            for t in e.args:
                r = _mul(r, self.of(t))
            return r
        if e.is_Pow:
            base, ex = e.args
            if ex.is_number:
                return _pow(self.of(base), float(ex))
            if base.is_number and float(base) > 0:  # b^x = exp(x log b)
                return _exp(_mul(self.of(ex), (math.log(float(base)),) * 2))
            return FULL
        if isinstance(e, sp.exp):
            return _exp(self.of(e.args[0]))
        if isinstance(e, sp.log):
            lo, hi = self.of(e.args[0])
            return FULL if hi <= 0 else (math.log(lo) if lo > 0 else -INF, math.log(hi))
        if isinstance(e, sp.Abs):
            lo, hi = self.of(e.args[0])
            return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0.0, max(-lo, hi))
        if isinstance(e, ir.squash):
            x = self.of(e.args[1])[1]  # m lies in (1/x, x) whatever P is
            return (1 / x, x) if x >= 1 else FULL
        return FULL


def domain_error(mixer: ir.Mixer):
    """(message, span) for a log, square root or fractional power whose argument's range, from the
    declared input ranges, reaches below 0 (nan for some admissible inputs); None if there is none."""
    ranges = Ranges(mixer)
    for e, span in mixer.expressions():
        for node in sp.preorder_traversal(sp.sympify(e)):
            if isinstance(node, sp.log):
                arg, what = node.args[0], "log"
            elif node.is_Pow and node.exp.is_number and not node.exp.is_integer:
                arg, what = node.base, "sqrt" if node.exp == sp.Rational(1, 2) else "a fractional power"
            else:
                continue
            lo, hi = ranges.of(arg)
            if lo < 0:
                return (f"{what} of {printer.expr(arg)} is nan for some "
                        f"admissible inputs: its argument ranges over {_iv((lo, hi))}; narrow the declared "
                        "ranges so that it stays >= 0", span)
    return None


# ---- the symbolic analysis -----------------------------------------------------------------------
def _per_channel(mixer, e) -> bool:
    kinds = mixer.kinds()
    return any(kinds.get(str(s)) in ("K", "V") for s in e.free_symbols)


def _iv(r) -> str:
    lo, hi = (-INF if r[0] is None else r[0]), (INF if r[1] is None else r[1])
    return f"[{lo:.4g}, {hi:.4g}]"


def analyse(mixer: ir.Mixer) -> dict:
    """The symbolic part of the check, with the pieces stability_error needs to name a culprit."""
    rg = Ranges(mixer)
    d = mixer.inline_lets(mixer.decay.value)
    D = rg.of(d)
    per_channel_d = mixer.decay.kind == "diagonal"
    out = {"D": D, "d": d, "W": None, "w": None, "factor": None, "symmetric": False, "notes": []}
    notes = out["notes"]
    dname = "per key channel" if per_channel_d else "one number per head"
    if mixer.delta is None:
        notes.append(f"M = D with D = {d} ({dname}); no erase term.")
        notes.append(f"M is diagonal: its eigenvalues are the values of D, in {_iv(D)}.")
        out.update(eig=D, proved=True)
        return out
    a, c = (mixer.inline_lets(x) for x in (mixer.delta.a, mixer.delta.c))
    out.update(a=a, c=c)
    shape = "(I - a c^T) D" if mixer.delta.order == "left" else "D (I - a c^T)"
    notes.append(f"M = {shape} with a = {mixer.delta.a}, c = {mixer.delta.c}, D = {d} ({dname}).")
    out["symmetric"] = not _per_channel(mixer, simplified(a / c))
    # c^T a = sum_i w_i u_i^2 with |u| = 1 is a convex combination of the w_i: the whole trick
    for u in (i for i in mixer.inputs if i.unit):
        w = simplified(c * a / u.symbol ** 2)
        if not w.has(u.symbol):
            W = rg.of(w)
            F = (min(1.0, 1 - W[1]), max(1.0, 1 - W[0]))
            out.update(w=w, W=W, factor=F)
            notes.append(f"{u.name} has unit norm and c*a = ({w}) {u.name}^2, so c^T a is a convex combination "
                         f"of values in {_iv(W)}: I - a c^T has eigenvalues 1 (K-1 times) and 1 - c^T a, "
                         f"all in {_iv(F)}.")
            break
    else:
        why = ("no input is declared unit or l2norm" if not any(i.unit for i in mixer.inputs)
               else "c*a is not a per-channel factor times the square of a unit input")
        notes.append(f"The eigenvalue 1 - c^T a cannot be bounded: {why}.")
        out.update(eig=FULL, proved=False)
        return out
    eig = _mul(F, D)
    if d == 1:
        notes.append("D = I, so the eigenvalues are those of I - a c^T.")
        proved = True
    elif not per_channel_d:
        notes.append(f"D is one number per head in {_iv(D)}, so the eigenvalues are exactly D and "
                     f"D (1 - c^T a): in {_iv(eig)}.")
        proved = True
    elif (D[0] >= 0 or D[1] <= 0) and (W[0] >= 0 or W[1] <= 0):
        # d_i and a_i c_i each of one sign: diag(sqrt(c_i d_i / a_i)) makes M symmetric, equal to
        # +-|D|^1/2 (I -+ y y^T) |D|^1/2 with y_i^2 = |a_i c_i|; its Rayleigh quotients split as a product
        notes.append(f"D and every a_i c_i each keep one sign, so M is similar to the symmetric "
                     f"|D|^1/2 (I - a c^T)_sym |D|^1/2 (times the sign of D): its eigenvalues are real and "
                     f"lie in {_iv(F)} x {_iv(D)} = {_iv(eig)}.")
        proved = True
    else:
        notes.append(f"D varies per channel and D or a_i c_i may change sign: {_iv(eig)} is a guess, "
                     "not a proof (the eigenvalues may even be complex).")
        proved = False
    out.update(eig=eig, proved=proved)
    return out


# ---- the numeric counterexample search ---------------------------------------------------------
def _box(lo, hi, lo_open, hi_open):
    """A finite box to sample a range from, and notable points of it (ends nudged inside when open)."""
    far = []
    if lo == -INF and hi == INF:
        lo, hi, far = -4.0, 4.0, [-1e3, 1e3]
    elif lo == -INF:
        lo, far = hi - 8, [hi - 1e3]
    elif hi == INF:
        hi, far = lo + 8, [lo + 1e3]
    eps = 1e-6 * max(1.0, hi - lo)
    lo, hi = lo + eps * lo_open, hi - eps * hi_open
    return lo, hi, [lo, hi, (lo + hi) / 2, lo + 1e-3 * (hi - lo), hi - 1e-3 * (hi - lo)] + far


def _sample(rng, box, shape):
    lo, hi, points = box
    x = rng.uniform(lo, hi, shape)
    pick = rng.random(shape) < 0.5  # half the entries at notable points: extremes live at corners
    return np.where(pick, rng.choice(points, shape), x)


def _unit(rng, n, K):
    if K == 2:  # a grid of angles: the worst directions for K = 2 are easy to miss at random
        t = rng.choice(np.linspace(0, np.pi, 49), n)
        return np.stack([np.cos(t), np.sin(t)], axis=1)
    x = rng.normal(size=(n, K)) * (rng.random((n, K)) < 0.7)  # some sparse directions too
    x[np.abs(x).sum(axis=1) == 0, 0] = 1.0
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def search(mixer: ir.Mixer, an: dict, n: int = 4096, seed: int = 0):
    """Largest ||M||_2 found over sampled inputs at the smallest K in (2, 3, 4) where it exceeds 1
    (else the largest over all three); None if nothing could be evaluated."""
    rng = np.random.default_rng(seed)
    rg, kinds = Ranges(mixer), mixer.kinds()
    exprs = [an["d"]] + ([an["a"], an["c"]] if mixer.delta else [])
    syms = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    inputs = {i.symbol: i for i in mixer.inputs}
    numeric = lambda e: sp.lambdify(syms, e.replace(lambda x: isinstance(x, ir.squash),
                                                    lambda x: x.definition()), "numpy")
    fns = [numeric(e) for e in exprs]
    lets = [(l, numeric(mixer.inline_lets(l.expr))) for l in mixer.lets
            if mixer.inline_lets(l.expr).free_symbols <= set(syms)]
    best = None
    for K in (2, 3, 4):
        env = {}
        for s in syms:
            shape = (n, K) if kinds.get(str(s)) in ("K", "V") else (n, 1)
            i = inputs.get(s)
            if s == ir.HEAD:
                env[s] = rng.integers(0, 8, shape).astype(float)
            elif i is not None and i.unit:
                env[s] = _unit(rng, n, K)
            elif i is not None:
                env[s] = _sample(rng, _box(float(i.lo), float(i.hi), i.lo_open, i.hi_open), shape)
            else:  # an aux state: anywhere in its inferred range
                env[s] = _sample(rng, _box(*rg.sym(s), False, False), shape)
        args = [env[s] for s in syms]
        with np.errstate(all="ignore"):
            d, *ac = (np.broadcast_to(np.asarray(f(*args), dtype=float), (n, K)) for f in fns)
            M = d[:, :, None] * np.eye(K)
            if ac:
                a, c = ac
                M = M - (a[:, :, None] * (c * d)[:, None, :] if mixer.delta.order == "left"
                         else (d * a)[:, :, None] * c[:, None, :])
            ok = np.isfinite(M).all(axis=(1, 2))
            if not ok.any():
                continue
            norms = np.full(n, -1.0)
            norms[ok] = np.linalg.norm(M[ok], 2, axis=(1, 2))
        j = int(np.argmax(norms))
        if best is None or norms[j] > best["spectral_norm"]:
            vals = {}
            for s in syms:
                v = env[s][j].tolist()
                prefix = "aux:" if s not in inputs and s != ir.HEAD else ""
                vals[prefix + str(s)] = v if len(v) > 1 else v[0]
            for l, f in lets:
                with np.errstate(all="ignore"):
                    v = np.broadcast_to(np.asarray(f(*args), dtype=float), (n, K))[j].tolist()
                vals["let:" + l.name] = v if l.kind != "scalar" else v[0]
            best = {"K": K, "inputs": vals, "spectral_norm": float(norms[j])}
        if best["spectral_norm"] > 1 + 1e-9:  # the smallest K that breaks the bound reads best
            break
    return best


# ---- the public entry points -------------------------------------------------------------------
def _json(x):
    return None if math.isinf(x) else float(x)


def _inside(r, lo=-1.0, hi=1.0) -> bool:
    return r[0] >= lo - TOL and r[1] <= hi + TOL


def check(mixer: ir.Mixer) -> dict:
    an = analyse(mixer)
    notes, eig, proved, D = list(an["notes"]), an["eig"], an["proved"], an["D"]
    norm, ce = "unknown", None
    if mixer.delta is None and _inside(D):
        norm = "proved"
        notes.append("M is diagonal with |D| <= 1, so ||M|| <= 1.")
    elif an["symmetric"] and an["factor"] is not None and _inside(an["factor"]) and _inside(D):
        norm = "proved"
        notes.append("a is a per-head multiple of c, so I - a c^T is symmetric with eigenvalues in [-1, 1], "
                     "and |D| <= 1: ||M|| <= ||I - a c^T|| ||D|| <= 1.")
    else:
        found = search(mixer, an)
        if found is not None and found["spectral_norm"] > 1 + 1e-9:
            norm, ce = "disproved", found
            why = " (M is not normal: its eigenvalues do not bound its norm)" if proved and _inside(eig) else ""
            notes.append(f"||M|| can exceed 1{why}: with K = {found['K']} a sample reaches "
                         f"||M|| = {found['spectral_norm']:.4g}.")
        else:
            notes.append("No proof that ||M|| <= 1, and no counterexample was found by sampling.")
    out = {
        "eigenvalues": {"min": _json(eig[0]), "max": _json(eig[1]), "proved": bool(proved)},
        "spectral_norm_le_1": norm,
        "counterexample": ce,
        "negative_eigenvalues": bool(proved and eig[0] < 0),
        "stable": bool(proved and _inside(eig)),
        "contraction": norm == "proved",
        "notes": notes,
    }
    if mixer.solve_lam is not None:
        out["solve_well_posed"] = _solve_well_posed(mixer, notes)
    return out


def _solve_well_posed(mixer: ir.Mixer, notes: list) -> bool:
    """The offline solve reads (G + diag(lam))^-1 q with G_t = D G_{t-1} + u k^T: G is positive
    semi-definite when D >= 0 and u is a non-negative per-head multiple of k, and then lam > 0 makes
    the matrix positive definite."""
    rng = Ranges(mixer)
    lam_lo = rng.of(mixer.inline_lets(mixer.solve_lam))[0]
    ratio = simplified(mixer.inline_lets(mixer.write.key) / ir.symbol("k"))
    per_head = not _per_channel(mixer, ratio)
    psd = bool(per_head and rng.of(ratio)[0] >= 0 and rng.of(mixer.decay.value)[0] >= 0)
    lam_in = next((i for i in mixer.inputs if i.symbol == mixer.solve_lam), None)
    positive = bool(lam_lo > 0 or (lam_in is not None and bool(lam_in.lo >= 0) and lam_in.lo_open))
    ok = psd and positive
    if ok:
        notes.append(f"The readout solves (G + diag(lam)) x = q: G = D G + ({ratio}) k k^T is positive "
                     f"semi-definite and lam > 0, so the solve is well posed.")
    else:
        notes.append("The readout's solve is not proved well posed: it needs D >= 0, a write key that is "
                     "a non-negative multiple of k, and lam > 0.")
    return ok


def explain(result: dict) -> str:
    e = result["eigenvalues"]
    rows = [("eigenvalues", f"{_iv((e['min'], e['max']))} ({'proved' if e['proved'] else 'not proved'})"),
            ("spectral norm <= 1", result["spectral_norm_le_1"]),
            ("negative eigenvalues", "yes" if result["negative_eigenvalues"] else "no"),
            ("stable", "yes" if result["stable"] else "no"),
            ("contraction", "yes" if result["contraction"] else "no")]
    ce = result["counterexample"]
    if ce:
        vals = ", ".join(f"{k}={np.round(v, 4).tolist()}" for k, v in ce["inputs"].items())
        rows.append(("counterexample", f"K={ce['K']}, ||M||={ce['spectral_norm']:.4g}: {vals}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows] + [f"  - {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def stability_error(mixer: ir.Mixer, result: dict) -> str | None:
    """One sentence for a spec whose stability is not proved (None when stable or allowed)."""
    if result.get("solve_well_posed") is False and not mixer.allow_unstable:
        return ("the readout's solve (G + diag(lamb))^-1 q is not proved well posed: declare the regulariser "
                "positive (e.g. `lamb[K] in (0, inf)`) and keep the write key a non-negative multiple of k")
    if result["stable"] or mixer.allow_unstable:
        return None
    e = result["eigenvalues"]
    if e["min"] is None and e["max"] is None and mixer.delta is not None:
        if not any(i.unit for i in mixer.inputs):
            return ("the eigenvalues of the transition cannot be bounded because no key is declared unit-norm; "
                    "declare `k[K] unit` or `l2norm`, or add `allow unstable`")
        return ("the eigenvalues of the transition cannot be bounded (c^T a is not a convex combination over a "
                "unit key); rewrite the erase as I - beta k k^T or add `allow unstable`")
    span = _iv((e["min"], e["max"]))
    if not e["proved"]:
        return (f"the eigenvalues of the transition could not be proved inside [-1, 1] (best guess {span}); "
                "keep the decay and the erase gains nonnegative or add `allow unstable`")
    an = analyse(mixer)
    culprits = an["w"] if an["factor"] is not None and not _inside(an["factor"]) else an["d"]
    names = sorted(str(s) for s in culprits.free_symbols if str(s) in {i.name for i in mixer.inputs})
    what = f"the range of {', '.join(names)}" if names else "the ranges"
    return f"eigenvalues of the transition reach {span} outside [-1, 1]; narrow {what} or add `allow unstable`"
