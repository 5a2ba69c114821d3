"""Intervals of per-token expressions, from the declared input ranges and the auxiliary states'
recurrences: exact by sympy's calculus for expressions in one input, interval arithmetic otherwise.
Every interval returned encloses the expression's values (sound, possibly loose)."""
from __future__ import annotations

import math

import sympy as sp

from . import ir, primitives
from .symbolic import MAX_SIMPLIFY_NESTING, nesting

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
