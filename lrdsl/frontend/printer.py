"""IR -> spec text. `explicit(mixer)` re-parses to the same IR; `canonical(mixer)` explains the form."""
from __future__ import annotations

import sympy as sp
from sympy.printing.str import StrPrinter

from lrdsl.frontend import ir, primitives


class _DslPrinter(StrPrinter):
    """sympy's str printer, in the spec language: '^' for powers, exact rationals, the functions by
    their names in the table of primitives."""

    def _print_Pow(self, expr, rational=False):
        b, e = expr.as_base_exp()
        if e == -1:
            return f"1/{self.parenthesize(b, 60)}"
        if e == sp.Rational(1, 2):
            return f"sqrt({self._print(b)})"
        if e.is_Rational and e < 0 and e.q == 1 and e != -1:
            return f"1/{self.parenthesize(b, 60)}^{-e.p}"
        base = self.parenthesize(b, 60)
        exp_ = self._print(e)
        if not (e.is_Integer and e >= 0) and not e.is_Symbol:
            exp_ = f"({exp_})"
        return f"{base}^{exp_}"

    def _print_Rational(self, expr):
        return f"{expr.p}/{expr.q}" if expr.q != 1 else str(expr.p)

    def _print_Exp1(self, expr):
        return "exp(1)"

    def _print_Infinity(self, expr):
        return "inf"

    def _print_NegativeInfinity(self, expr):
        return "-inf"


def _printer_of(prim):
    def method(self, e):
        args = [self._print(a) for a in e.args]
        return prim.printed(*args) if prim.printed else f"{prim.name}({', '.join(args)})"
    return method


for _prim in primitives.TABLE:  # exp(...), abs(...), softplus(...), max(...), squash(P, x = ..., ...)
    if _prim.cls is not None and _prim.name:
        setattr(_DslPrinter, f"_print_{_prim.cls.__name__}", _printer_of(_prim))


_SIGMOID, _CLAMP = sp.Function("sigmoid"), sp.Function("clamp")


def _is_sigmoid(e) -> bool:  # 1/(1 + exp(u)), which the lowering builds for sigmoid(-u)
    return (e.is_Pow and e.exp == -1 and e.base.is_Add and len(e.base.args) == 2 and sp.S.One in e.base.args
            and all(t == 1 or isinstance(t, sp.exp) for t in e.base.args))


def _is_clamp(e) -> bool:  # min(max(x, lo), hi) with numbers lo < hi, which clamp(x, lo, hi) builds
    if not (isinstance(e, sp.Min) and len(e.args) == 2):
        return False
    hi, inner = sorted(e.args, key=lambda a: not a.is_number)
    if not (hi.is_number and isinstance(inner, sp.Max) and len(inner.args) == 2):
        return False
    lo, x = sorted(inner.args, key=lambda a: not a.is_number)
    return bool(lo.is_number and not x.is_number and lo < hi)


def _clamp(e):
    hi, inner = sorted(e.args, key=lambda a: not a.is_number)
    lo, x = sorted(inner.args, key=lambda a: not a.is_number)
    return _CLAMP(x, lo, hi)


def named(e: sp.Expr) -> sp.Expr:
    """e with the functions that the lowering writes out put back under their spec names: sigmoid
    (1/(1 + exp(-x))) and clamp (min(max(x, lo), hi)); they re-parse to the same IR."""
    e = sp.sympify(e)
    e = e.replace(_is_sigmoid, lambda p: _SIGMOID(-next(t for t in p.base.args if t != 1).args[0]))
    return e.replace(_is_clamp, _clamp)


def expr(e: sp.Expr) -> str:
    return _DslPrinter().doprint(named(e))


def _vec(e: sp.Expr) -> str:
    s = expr(e)
    return s if isinstance(e, sp.Symbol) else f"({s})"


def _range(i: ir.Input) -> str:
    if i.unit or i.l2norm or i.log or (i.lo == -sp.oo and i.hi == sp.oo):
        return ""
    return f" in {'(' if i.lo_open else '['}{_bound(i.lo)}, {_bound(i.hi)}{')' if i.hi_open else ']'}"


def _bound(x: sp.Expr) -> str:
    """A range's end as the grammar reads it: inf, or a decimal number (0.5, not 1/2)."""
    if not x.is_Rational:
        return expr(x)
    from fractions import Fraction

    from lrdsl.frontend.params import decimal_text
    return decimal_text(Fraction(int(x.p), int(x.q)))


def decl(i: ir.Input) -> str:
    attrs = [a for a, on in (("l2norm", i.l2norm), ("unit", i.unit and not i.l2norm), ("log", i.log),
                              ("shared", i.shared and i.name not in ("q", "k"))) if on]
    shape = f"[{i.kind}]" if i.kind != "scalar" else ""
    return f"{i.name}{shape}{''.join(' ' + a for a in attrs)}{_range(i)}"


def param_decl(p: ir.Param) -> str:
    """A param as declared: name, [K] or [V], range, init (always printed: the default depends on the name)."""
    from lrdsl.frontend.params import init_text
    shape = "" if p.kind == "scalar" else f"[{p.kind}]"
    return f"{p.name}{shape}{_range(p)} init {init_text(p.init)}"


def transition(m: ir.Mixer) -> str:
    """The transition M_t as spec text (without the trailing S); a two-sided one's "M S N" in full."""
    if m.side == "both":
        M, N = transition(m.left_part()), transition(m.right_part())
        return " ".join(t for t in (M if M != "I" else "", "S", N if N != "I" else "") if t)
    d = m.decay
    if d.kind == "diagonal":
        dtext = f"diag({expr(d.value)})"
    elif d.kind == "identity":
        dtext = ""
    else:
        atomic = isinstance(d.value, (sp.Symbol, sp.Function)) or d.value.is_Number
        dtext = expr(d.value) if atomic else _vec(d.value)
    if m.delta is None:
        return dtext or "I"
    if m.delta.order == "sum":
        dpart = dtext if d.kind in ("diagonal", "identity") else f"{dtext} I"
        return f"({dpart or 'I'} - {_vec(m.delta.a)} {_vec(m.delta.c)}^T)"
    erase = f"(I - {_vec(m.delta.a)} {_vec(m.delta.c)}^T)"
    if not dtext:
        return erase
    return f"{erase} {dtext}" if m.delta.order == "left" else f"{dtext} {erase}"


def product(m: ir.Mixer) -> str:
    """The whole transition M_t of a token (a product's factors, the last leftmost) as spec text."""
    erases = [f"(I - {_vec(st.delta.a)} {_vec(st.delta.c)}^T)" for st in reversed(m.steps) if st.delta is not None]
    t = transition(m)
    return " ".join(erases + ([] if t == "I" and erases else [t]))


def explicit(m: ir.Mixer) -> str:
    lines = [f"mixer {m.name}", "input " + ", ".join(decl(i) for i in m.inputs)]
    if m.params:
        lines.append("param " + ", ".join(param_decl(p) for p in m.params))
    for a in m.aux:
        lines.append(f"state {a.name}[{a.kind}] = {expr(a.decay * ir.symbol(a.name) + a.write)}")
    for lt in m.lets:
        lines.append(f"let {lt.name} = {expr(lt.expr)}")
    lines.append(f"S = {update(m)}")
    lines.append(f"o = {readout(m)}")
    if m.solve_lam is not None and m.solve_steps != ir.Mixer.solve_steps:
        lines.append(f"solve offline steps {m.solve_steps}")
    if m.allow_unstable:
        lines.append("allow unstable")
    if m.allow_ill_conditioned:
        lines.append("allow ill_conditioned")
    return "\n".join(lines) + "\n"


def update(m: ir.Mixer) -> str:
    """The right-hand side of the update line: S = <this>; a product of steps nested, innermost first."""
    t = transition(m)
    carried = "S" if t == "I" else t if m.side == "both" else f"S {t}" if m.side == "right" else f"{t} S"
    out = f"{carried} + {_vec(m.write.key)} {_vec(m.write.value)}^T"
    for st in m.steps:
        erase = "" if st.delta is None else f"(I - {_vec(st.delta.a)} {_vec(st.delta.c)}^T) "
        out = f"{erase}({out}) + {_vec(st.write.key)} {_vec(st.write.value)}^T"
    return out


def readout(m: ir.Mixer) -> str:
    """The right-hand side of the readout line: o = <this>."""
    if m.solve_lam is not None:
        return f"S^T (G + diag({expr(m.solve_lam)}))^-1 {_vec(m.query)}"
    terms = [f"S^T {_vec(m.query)}"] if m.query != 0 else []
    terms += [f"S_prev^T {_vec(m.query_prev)}"] if m.query_prev != 0 else []
    terms += [f"({_dot(b)}) {_vec(b.value)}" for b in m.bonus]
    return " + ".join(terms)


def _dot(b: ir.Bonus) -> str:
    """x^T y with x y = b.summand: x one of its symbols of b.kind, y the rest."""
    syms = sorted((s for s in b.summand.free_symbols if s != ir.HEAD), key=str)
    for s in syms:
        rest = sp.factor_terms(b.summand / s)
        if s * rest == b.summand:
            return f"{s}^T {_vec(rest)}"
    return f"{_vec(b.summand)}^T 1"


def canonical(m: ir.Mixer) -> str:
    """The canonical form in words: decay class, erase factor, write, readout."""
    if m.side == "both":  # M's lines, then N's
        M, N = (canonical(p).splitlines() for p in (m.left_part(), m.right_part()))
        out = [line for line in M if line.startswith(("decay", "erase"))]
        out += [line for line in N if line.startswith(("decay", "erase"))]
        out.append("side    both      S = M S N + write (M [K, K] from the left, N [V, V] from the right)")
        out += [line for line in M if not line.startswith(("decay", "erase"))]
        return "\n".join(out) + "\n"
    d = m.decay
    out = [f"decay   {d.kind:9s} D = {expr(d.value) if d.kind != 'identity' else 'I'}"]
    if m.delta is None:
        out.append("erase   none      N = D" if m.side == "right" else "erase   none      M = D")
    else:
        form = {"left": "(I - a c^T) D", "right": "D (I - a c^T)", "sum": "D - a c^T"}[m.delta.order]
        M = "N" if m.side == "right" else "M"
        out.append(f"erase   rank-1    {M} = {form},  a = {expr(m.delta.a)},  c = {expr(m.delta.c)}")
    if m.side == "right":
        out.append("side    value     S = S N + write (N [V, V] multiplies the state's rows from the right)")
    out.append(f"write   rank-1    {_vec(m.write.key)} {_vec(m.write.value)}^T")
    for i, st in enumerate(m.steps, 2):
        erase = "none" if st.delta is None else f"(I - a c^T),  a = {expr(st.delta.a)},  c = {expr(st.delta.c)}"
        out.append(f"step {i}  rank-1    M = {erase}, then write {_vec(st.write.key)} {_vec(st.write.value)}^T")
    if m.steps:
        out.append(f"product           {m.n_steps} steps per token (the decay on the first): chunk and "
                   f"recurrent run them as {m.n_steps} sub-tokens of one step each")
    if m.solve_lam is None and m.reads_before:
        out.append(f"readout           o = scale * ({readout(m)})")
        out.append("                  (S_prev: the state before the token's update)")
    elif m.solve_lam is None:
        out.append(f"readout           o = S^T (scale * {expr(m.query)})")
    else:
        out.append(f"readout           o = S^T (G + diag({expr(m.solve_lam)}))^-1 (scale * {expr(m.query)})")
        out.append(f"gram    offline   G = D G + {_vec(m.write.key)} k^T (exact solve, Mesa; "
                   f"{m.solve_steps} conjugate-gradient steps in the kernels)")
    for a in m.aux:
        out.append(f"aux     {a.name}[{a.kind}]  = {expr(a.decay)} * {a.name} + {expr(a.write)}")
    for p in m.params:
        out.append(f"param   {param_decl(p)}  (learned: [HV{'' if p.kind == 'scalar' else ', ' + p.kind}])")
    for lt in m.lets:
        out.append(f"let     {lt.name} = {expr(lt.expr)}")
    norm = [i.name for i in m.inputs if i.l2norm]
    if norm:
        out.append(f"l2norm  {', '.join(norm)} (inside the mixer)")
    return "\n".join(out) + "\n"
