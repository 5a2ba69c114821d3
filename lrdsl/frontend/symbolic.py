"""Bounded symbolic work and the limits that keep it bounded. sympy's simplify takes time
exponential in the nesting of functions (8 nested sigmoids: 30 s; 20 nested exps: minutes), and a
spec must compile or be refused within seconds; the analysis only needs common factors cancelled
and zeros recognised. Constants must fit float32, in which the kernels compute."""
from __future__ import annotations

import sympy as sp

from lrdsl.errors import SpecError
from lrdsl.frontend import ir

MAX_SIMPLIFY_NESTING = 3  # deeper expressions get only the cheap rewrites


MAX_INLINED_DEPTH = 64  # a let chain deeper than this is refused (sympy recurses on it)


def _depth(e: sp.Basic, leaf, functions_only: bool) -> int:
    """Longest path from the root of e to a leaf, iteratively (no recursion limit); leaf(symbol)
    gives the depth a symbol stands for (a let's own depth), functions_only counts only function
    applications."""
    best, stack = 0, [(e, 0)]
    while stack:
        node, d = stack.pop()
        if not isinstance(node, sp.Basic):
            continue
        if isinstance(node, sp.Symbol):
            best = max(best, d + leaf(node))
            continue
        step = 1 if (isinstance(node, sp.Function) or not functions_only) else 0
        if not node.args:
            best = max(best, d)
        stack.extend((a, d + step) for a in node.args)
    return best


def nesting(e: sp.Basic) -> int:
    """Largest number of function applications (exp, log, squash, ...) along one path of e."""
    return _depth(e, lambda s: 0, True)


def inlined_depth(e: sp.Basic) -> int:
    """Depth of the expression tree of e (of a let with the lets it uses substituted)."""
    return _depth(e, lambda s: 0, False)


def simplified(e: sp.Basic) -> sp.Basic:
    """sympy.simplify(e) for shallow expressions; common factors pulled out for deep ones."""
    e = sp.sympify(e)
    if nesting(e) > MAX_SIMPLIFY_NESTING:
        return sp.factor_terms(e)
    return sp.simplify(e)


FLOAT32_MAX = sp.Float(3.4028234663852886e38)


def check_constants(m: ir.Mixer, span) -> None:
    """Constants (after folding, e.g. 1e300*1e300) must fit float32, in which the kernels compute."""
    for e, _ in m.expressions():
        for n in sp.sympify(e).atoms(sp.Number):
            if n.is_finite is False or n == sp.nan or abs(n) > FLOAT32_MAX:
                raise SpecError(f"the constant {sp.N(n, 3)} is beyond float32's range (+-3.4e38), in which "
                                "the kernels compute; use a smaller constant", span)
