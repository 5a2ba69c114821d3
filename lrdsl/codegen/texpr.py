"""sympy expression -> Triton source text (a named hole of a template).

Symbols become the block variables the templates load (`b_<name>`, names already validated as
plain identifiers by the front end); the head index h becomes `h_f`. Nothing else from the spec
reaches generated code. Functions (exp, log, abs, softplus, max, ...) are lowered by the texts of
lrdsl/primitives.py's table.
"""
from __future__ import annotations

import math

import sympy as sp

from lrdsl.frontend import primitives


def var(name: str) -> str:
    return "h_f" if name == "h" else f"b_{name}"


def number(x) -> str:
    v = float(x)
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(v)


def code(e: sp.Expr) -> str:
    """Triton expression text for e (elementwise over the loaded blocks, fp32)."""
    if isinstance(e, sp.Symbol):
        return var(e.name)
    if e.is_number:  # constant subexpressions, e.g. log(3/2), fold to one literal
        return number(sp.N(e, 17))
    if isinstance(e, sp.Add):
        parts = [code(a) for a in e.args]
        return "(" + " + ".join(parts) + ")"
    if isinstance(e, sp.Mul):
        num, den = [], []
        for a in e.args:
            if isinstance(a, sp.Pow) and a.exp.is_Number and a.exp < 0:
                den.append(code(sp.Pow(a.base, -a.exp)))
            elif a == -1:
                num.insert(0, "-1.0")
            else:
                num.append(code(a))
        text = " * ".join(num) if num else "1.0"
        if den:
            text = f"({text}) / ({' * '.join(den)})"
        return f"({text})"
    if isinstance(e, sp.Pow):
        b, x = e.base, e.exp
        if b.is_Number:
            return f"tl.exp({code(x)} * {number(math.log(float(b)))})"
        if x.is_Integer and 0 < x <= 4:
            return "(" + " * ".join([code(b)] * int(x)) + ")"
        if x.is_Integer and -4 <= x < 0:
            return f"(1.0 / {code(sp.Pow(b, -x))})"
        if x == sp.Rational(1, 2):
            return f"tl.sqrt({code(b)})"
        if x == sp.Rational(-1, 2):
            return f"(1.0 / tl.sqrt({code(b)}))"
        return f"tl.exp({code(x)} * tl.log({code(b)}))"
    prim = primitives.of(e)  # exp, log, abs, softplus, ...: the table's text
    if prim is not None and prim.triton is not None:
        return prim.triton(*(code(a) for a in e.args))
    if prim is not None and prim.expand is not None:
        return code(prim.expand(e))
    raise TypeError(f"no Triton lowering for {e!r}")  # the front end admits nothing else
