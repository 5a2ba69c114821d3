"""Intervals of per-token expressions, from the declared input ranges and the auxiliary states'
recurrences: exact by sympy's calculus for expressions in one input, interval arithmetic otherwise.
Every interval returned encloses the expression's values (sound, possibly loose)."""
from __future__ import annotations

import math

import sympy as sp

from lrdsl.frontend import ir, primitives
from lrdsl.frontend.symbolic import MAX_SIMPLIFY_NESTING, nesting

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


# functions sympy's function_range handles slowly or not at all (tanh(b) + silu(b) clamped: a minute)
NOT_FOR_CALCULUS = (sp.Min, sp.Max, sp.tanh, sp.Heaviside, sp.sign, primitives.softplus, primitives.log1p,
                    primitives.silu)


def _meet(a, b):
    """The intersection of two enclosures of the same values."""
    return max(a[0], b[0]), min(a[1], b[1])


class Ranges:
    """Interval of any per-token expression, from the declared input ranges and inferred states."""

    def __init__(self, mixer: ir.Mixer):
        self.inputs = {i.symbol: i for i in (*mixer.inputs, *mixer.params)}  # a param: its declared range
        self.aux = {ir.symbol(a.name): a for a in mixer.aux}
        self.lets = {ir.symbol(l.name): l for l in mixer.lets}
        self.memo = {}
        self.corner_memo = {}
        self.in_derivative = False  # ranging a partial derivative: no corner analysis inside it

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
        if i is None or self.in_derivative or nesting(e) > MAX_SIMPLIFY_NESTING or sp.count_ops(e) > 40:
            return None
        if e.has(*NOT_FOR_CALCULUS):  # sympy's calculus takes minutes over these: corners() does them
            return None
        from sympy.calculus.util import function_range
        try:
            r = function_range(e, x, sp.Interval(i.lo, i.hi, i.lo_open, i.hi_open))
        except Exception:  # sympy could not decide (NotImplementedError and kin): fall back
            return None
        if not isinstance(r, sp.Interval) or not (r.inf.is_real and r.sup.is_real):
            return None
        return float(r.inf), float(r.sup)

    def _end(self, s, upper: bool):
        """The lower or upper end of a symbol's range, as a sympy number (exact for inputs)."""
        i = self.inputs.get(s)
        if i is not None:
            return i.hi if upper else i.lo
        v = self.sym(s)[upper]
        return sp.oo if v == INF else -sp.oo if v == -INF else sp.Float(v)

    def _at(self, e, s, upper: bool):
        """e at one end of s's range: substituted, or its one-sided limit where that is 0/0 or an
        infinite end; None where sympy cannot say."""
        v = self._end(s, upper)
        if v.is_finite:
            out = e.subs(s, v)
            if not out.has(sp.nan, sp.zoo, sp.oo, -sp.oo):
                return out
        try:
            out = sp.limit(e, s, v, "-" if upper else "+")
        except Exception:  # sympy could not decide (NotImplementedError and kin)
            return None
        return None if out.has(sp.nan, sp.zoo, sp.AccumBounds, sp.Limit) else out

    def corners(self, e):
        """The range of e from its monotonicity in each symbol: where a partial derivative keeps one
        sign over the box (by the ranges of the derivative), the extremes lie on that face of the box,
        so the symbol is fixed at the matching end and the rest ranged (exact at the corners when every
        symbol is monotone: b c / (b + c) on (0, 1)^2 gives (0, 1/2)); None where no symbol is."""
        syms = sorted(e.free_symbols, key=str)
        if self.in_derivative or not 1 <= len(syms) <= 4 or sp.count_ops(e) > 40 or \
                nesting(e) > MAX_SIMPLIFY_NESTING:
            return None
        if e in self.corner_memo:
            return self.corner_memo[e]
        self.corner_memo[e] = None  # a let ranged through itself meets this
        # a derivative's sign says nothing across a pole (-b/e^2 <= 0, yet b/e spans the line for e
        # in (-1, 1)): every divisor must keep one sign over the box
        if any(p.exp.is_negative and self.of(p.base)[0] < 0 < self.of(p.base)[1] for p in e.atoms(sp.Pow)):
            return None
        self.in_derivative, signs = True, {}
        try:
            for s in syms:
                d = sp.diff(e, s)
                lo, hi = _meet(self.of(d), self.of(sp.factor(d)))  # c/(b+c) - bc/(b+c)^2 = c^2/(b+c)^2
                if lo >= 0 or hi <= 0:
                    signs[s] = lo >= 0
        finally:
            self.in_derivative = False
        out = None
        if signs:
            ends = []
            for upper in (False, True):
                f = e
                for s, rising in signs.items():
                    f = self._at(f, s, upper == rising) if f is not None else None
                ends.append(None if f is None else self.of(f)[upper])
            out = None if None in ends else tuple(ends)
        self.corner_memo[e] = out
        return out

    def of(self, e) -> tuple:
        if not e.is_number and not e.is_Symbol:
            r = self.exact(e) or self.corners(e)
            if r is not None:
                return r
        if e.is_number:
            v = complex(e)
            return (v.real, v.real) if v.imag == 0 else FULL
        if e.is_Symbol:
            return self.sym(e)
        if (e.is_Add or e.is_Mul) and len(e.args) > 2:
            # terms (factors) in the same symbols are one sub-expression, ranged as a whole: exactly
            # for one input (-b (b - 2) times m lies in [0, 1] x m, not [0, 2] x m)
            groups = {}
            for t in e.args:
                groups.setdefault(frozenset(t.free_symbols), []).append(t)
            if 1 < len(groups) < len(e.args):
                e = e.func(*(e.func(*g, evaluate=False) if len(g) > 1 else g[0] for g in groups.values()),
                           evaluate=False)
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
                return primitives.BY_NAME["exp"].range(_mul(self.of(ex), (math.log(float(base)),) * 2))
            return FULL
        prim = primitives.of(e)  # exp, log, abs, softplus, max, squash, ...: the table's rule
        if prim is not None and prim.range is not None:
            return prim.range(*(self.of(a) for a in e.args))
        return FULL
