"""Explicit-form AST -> canonical IR.

Expressions are typed as they are lowered: an elementwise value (one number per head, per key
channel or per value channel), a row vector, a K x K matrix (a sum of diag(d) and u c^T terms),
a [K, V] state expression (M S terms plus rank-1 writes), S^T, or the readout S^T x. Products
are expanded term by term, so whatever order the user wrote the transition in, it normalises to
(I - a c^T) D, D (I - a c^T) or D - a c^T plus one write (transition.py), or is refused with the
form that was found.
"""
from __future__ import annotations

import difflib
import keyword
import re
import sys

import sympy as sp

from lrdsl.errors import SpecError
from lrdsl.frontend import ir, primitives
from lrdsl.frontend.combos import check_before_terms, check_product, check_readout, check_value_side
from lrdsl.frontend.desugar import desugar
from lrdsl.frontend.params import declared_range, lower_params
from lrdsl.frontend.steps import compose
from lrdsl.frontend.symbolic import MAX_INLINED_DEPTH, check_constants, inlined_depth, simplified
from lrdsl.frontend.syntax import (
    Allow,
    BinOp,
    Call,
    Inputs,
    Let,
    Neg,
    Num,
    Params,
    Readout,
    Spec,
    StateDecl,
    Transpose,
    Update,
    Var,
)
from lrdsl.frontend.transition import transition
from lrdsl.frontend.values import Dot, Gram, GramInv, Mat, Out, Row, St, StPrev, StT, Val
from lrdsl.frontend.values import describe as _desc

RESERVED = {"S", "S_prev", "G", "I", "T", "o", "h", "inf", *primitives.NAMES, "diag",
            "mixer", "input", "param", "state", "let", "allow", "decay", "gain", "precond", "solve", "normalize",
            "in", "unit", "l2norm", "shared", "none", "constant", "scalar", "diagonal", "channelwise",
            "atk", "atq", "online", "offline", "scale", "initial_state", "output_final_state",
            "cu_seqlens", "self", "mixer_name", "torch", "triton", "tl", "math", "inputs"}
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,31}\Z")
ALLOWS = {"unstable", "ill_conditioned"}


def check_name(name: str, span, what: str = "name") -> None:
    """Names reach generated code and keyword arguments: keep them plain identifiers."""
    article = "an" if what[0] in "aeiou" else "a"
    if name in RESERVED or keyword.iskeyword(name) or name.startswith("_"):
        raise SpecError(f"'{name}' is reserved and cannot be used as {article} {what}; choose another name",
                        span)
    if not NAME_RE.match(name):
        raise SpecError(f"'{name}' is not a valid {what}: use letters, digits and '_', starting "
                        "with a letter, at most 32 characters", span)


MAX_CONSTANT_BITS = 4096  # numerator and denominator of an exact constant (2^4096 ~ 1e1233)


def _check_constant(e: sp.Expr, span) -> None:
    """A constant must be a finite real number of sane size (1/0, log(-1), 2^1000000 are refused)."""
    if e.has(sp.zoo, sp.nan, sp.oo, -sp.oo) or e.is_number and (e.is_finite is False
                                                                or e.is_extended_real is False):
        raise SpecError(f"this constant is not a finite real number ({e}); check divisions by zero and "
                        "log or sqrt of negative numbers", span)
    big = any(max(abs(r.p), r.q).bit_length() > MAX_CONSTANT_BITS for r in e.atoms(sp.Rational))
    if e.is_number and not big and not isinstance(e, sp.Rational):
        try:
            big = not abs(complex(e)) <= 1e300  # exp(exp(1000)) and the like
        except (OverflowError, ValueError, TypeError):
            big = True
    if big:
        raise SpecError("this constant is too large or too small to represent; lrdsl computes in floating "
                        "point, so keep constants between about 1e-300 and 1e300", span)


def _join(a: str, b: str, span, what: str) -> str:
    if a == b or b == "scalar":
        return a
    if a == "scalar":
        return b
    raise SpecError(f"cannot {what} a [{a}] vector and a [{b}] vector elementwise; K and V channels differ",
                    span)


class Lowerer:
    def __init__(self):
        self.kinds = {"h": "scalar"}
        self.symbols = {"h": ir.HEAD}
        self.defined_at = {}

    def name_error(self, name: str, span, called: bool = False) -> SpecError:
        functions = difflib.get_close_matches(name, (*primitives.NAMES, "diag"), n=1) if called else []
        if functions:  # `sigmod(b)` parses as the product of a name and (b)
            return SpecError(f"unknown function '{name}'; did you mean {functions[0]}(...)?", span)
        known = sorted(n for n in self.kinds if n != "h")
        close = difflib.get_close_matches(name, known, n=1)
        valid = not (name in RESERVED or keyword.iskeyword(name) or name.startswith("_")) and NAME_RE.match(name)
        hint = f"; did you mean '{close[0]}'?" if close else f"; declare it with `input {name}` or `param {name}`" if valid else ""
        return SpecError(f"unknown name '{name}'{hint}", span)

    # -- expressions
    def expr(self, node):
        m = getattr(self, "e_" + type(node).__name__)
        out = m(node)
        if isinstance(out, Val):
            _check_constant(out.expr, node.span)
        return out

    def e_Num(self, n: Num):
        return Val("scalar", sp.Rational(n.value.numerator, n.value.denominator))

    def e_Var(self, n: Var):
        if n.name == "I":
            return Mat((("diag", sp.Integer(1)),), "")
        if n.name == "S":
            return St((("diag", sp.Integer(1)),), ())
        if n.name == "S_prev":
            return StPrev()
        if n.name == "G":
            return Gram(sp.Integer(0))
        if n.name not in self.kinds:
            raise self.name_error(n.name, n.span, n.called)
        return Val(self.kinds[n.name], self.symbols[n.name])

    def e_Neg(self, n: Neg):
        return self.scale(self.expr(n.x), sp.Integer(-1), n.span)

    def e_Transpose(self, n: Transpose):
        x = self.expr(n.x)
        if isinstance(x, Val):
            if x.kind == "scalar":
                return x
            return Row(x.kind, x.expr)
        if isinstance(x, Row):
            return Val(x.kind, x.expr)
        if isinstance(x, Mat):
            return Mat(tuple(t if t[0] == "diag" else ("outer", t[2], t[1]) for t in x.terms), x.dim)
        if isinstance(x, St) and x.carried == (("diag", 1),) and not x.writes and not x.inner:
            return StT()
        if isinstance(x, StPrev) and not x.transposed:
            return StPrev(True)
        raise SpecError(f"cannot transpose {_desc(x)}; only vectors, [K, K] matrices and S itself (in the "
                        "readout o = S^T q) can be transposed", n.span)

    def e_Call(self, n: Call):
        f = n.func
        if f == "squash":
            return self.squash(n)
        if n.kwargs:
            raise SpecError(f"{f}(...) takes no named arguments", n.span)
        prim = primitives.BY_NAME.get(f)
        want = 1 if prim is None else prim.arity
        if len(n.args) != want and not (want == 0 and len(n.args) >= 2):
            wanted = "two or more arguments" if want == 0 else "one argument" if want == 1 else f"{want} arguments"
            usage = f"; write {f}({prim.params})" if prim else ""
            raise SpecError(f"{f}(...) takes {wanted}, got {len(n.args)}{usage}", n.span)
        xs = [self.expr(a) for a in n.args]
        if f == "diag":
            x = xs[0]
            if not isinstance(x, Val):
                raise SpecError(f"diag(...) takes a [K] or [V] vector (or a number), not {_desc(x)}", n.span)
            return Mat((("diag", x.expr),), {"scalar": ""}.get(x.kind, x.kind))
        for x in xs:
            if not isinstance(x, Val):
                raise SpecError(f"{f}(...) applies elementwise to numbers and vectors, not to {_desc(x)}", n.span)
        kind = xs[0].kind
        for x in xs[1:]:
            kind = _join(kind, x.kind, n.span, f"take {f}(...) of")
        return Val(kind, prim.form(*(x.expr for x in xs)))

    def squash(self, n: Call):
        if len(n.args) != 1:
            raise SpecError("squash(...) takes one vector and the options x and center, "
                            "e.g. squash(P, x = 1.5, center = -0.2)", n.span)
        x = self.expr(n.args[0])
        if not isinstance(x, Val):
            raise SpecError(f"squash(...) applies elementwise, not to {_desc(x)}", n.span)
        opts = {"x": sp.Rational(3, 2), "center": sp.Rational(-1, 5)}
        for name, node in n.kwargs:
            if name not in opts:
                raise SpecError(f"squash(...) has no option '{name}'; its options are x and center", n.span)
            val = self.expr(node)
            if not (isinstance(val, Val) and val.expr.is_number):
                raise SpecError(f"squash option {name} must be a number", n.span)
            opts[name] = val.expr
        if not (opts["x"].is_number and opts["x"] > 1):
            raise SpecError("squash option x must be greater than 1 (m lies in (1/x, x))", n.span)
        return Val(x.kind, ir.squash(x.expr, opts["x"], opts["center"]))

    def e_BinOp(self, n: BinOp):
        a, b = self.expr(n.lhs), self.expr(n.rhs)
        return getattr(self, "op_" + n.op)(a, b, n)

    def op_add(self, a, b, n, sign=1):
        for g, d in ((a, b), (b, a)):
            if isinstance(g, Gram) and isinstance(d, Mat) and sign == 1 and all(t[0] == "diag" for t in d.terms):
                return Gram(g.lam + sum((t[1] for t in d.terms), sp.Integer(0)))
        if isinstance(a, Val) and isinstance(b, Val):
            return Val(_join(a.kind, b.kind, n.span, "add"), a.expr + sign * b.expr)
        if isinstance(a, Out) and isinstance(b, Out) and a.lam is None and b.lam is None:
            b = self.scale(b, sign, n.span)
            return Out(a.query + b.query, None, a.prev + b.prev, a.bonus + b.bonus)
        if isinstance(a, Dot) and isinstance(b, Dot) and a.kind == b.kind:
            return Dot(a.kind, a.expr + sign * b.expr)
        if isinstance(a, Mat) and isinstance(b, Mat):
            return Mat(a.terms + self.scale(b, sign, n.span).terms, _dims(a, b, n.span))
        if isinstance(a, St) and isinstance(b, St):
            b = self.scale(b, sign, n.span)
            if a.inner and b.inner or (a.inner and b.carried) or (b.inner and a.carried):
                raise SpecError("in a product of steps, S enters once, innermost: write the steps nested, "
                                "(I - a2 c2^T) ((I - a1 c1^T) D S + u1 z1^T) + u2 z2^T", n.span)
            return St(a.carried + b.carried, a.writes + b.writes, a.inner or b.inner, side=_sides(a, b, n.span),
                      right=a.right or b.right)
        hint = "; write I for the identity matrix" if {type(a), type(b)} == {Val, Mat} else ""
        raise SpecError(f"cannot {'add' if sign == 1 else 'subtract'} {_desc(b)} "
                        f"{'to' if sign == 1 else 'from'} {_desc(a)}{hint}", n.span)

    def op_sub(self, a, b, n):
        return self.op_add(a, b, n, sign=-1)

    def op_emul(self, a, b, n):
        if isinstance(a, Val) and isinstance(b, Val):
            return Val(_join(a.kind, b.kind, n.span, "multiply"), a.expr * b.expr)
        for s, o in ((a, b), (b, a)):
            if isinstance(s, Val) and s.kind == "scalar":
                return self.scale(o, s.expr, n.span)
        if isinstance(a, Dot) or isinstance(b, Dot):
            return self.dot_times(a, b, n.span)
        raise SpecError(f"'*' is elementwise: cannot multiply {_desc(a)} by {_desc(b)}; use diag(x) for a "
                        "diagonal matrix and juxtaposition (A S, k v^T) for matrix products", n.span)

    def op_ediv(self, a, b, n):
        if isinstance(b, Val) and b.expr.is_zero:
            raise SpecError("division by zero", n.span)
        if isinstance(b, Val) and isinstance(a, Val):
            return Val(_join(a.kind, b.kind, n.span, "divide"), a.expr / b.expr)
        if isinstance(b, Val) and b.kind == "scalar":
            return self.scale(a, 1 / b.expr, n.span)
        raise SpecError(f"cannot divide {_desc(a)} by {_desc(b)}", n.span)

    def op_pow(self, a, b, n):
        if isinstance(a, Gram):
            if not (isinstance(b, Val) and b.expr == -1):
                raise SpecError("the Gram state enters the readout only as (G + diag(lamb))^-1", n.span)
            return GramInv(a.lam)
        if isinstance(a, Val) and isinstance(b, Val):
            if a.expr.is_number and b.expr.is_number and abs(b.expr) > MAX_CONSTANT_BITS:
                raise SpecError(f"the exponent {b.expr} is too large; lrdsl computes in floating point", n.span)
            return Val(_join(a.kind, b.kind, n.span, "raise"), a.expr ** b.expr)
        raise SpecError(f"'^' raises numbers and vectors elementwise, not {_desc(a)}; use '^T' to "
                        "transpose", n.span)

    def scale(self, x, s, span):
        if isinstance(x, Val):
            return Val(x.kind, s * x.expr)
        if isinstance(x, Row):
            return Row(x.kind, s * x.expr)
        if isinstance(x, Mat):
            return Mat(tuple(("diag", s * t[1]) if t[0] == "diag" else ("outer", s * t[1], t[2])
                             for t in x.terms), x.dim)
        if isinstance(x, St):
            return St(self.scale(Mat(x.carried), s, span).terms, tuple((s * u, z) for u, z in x.writes), x.inner,
                      side=x.side, right=x.right)
        if isinstance(x, Out):
            return Out(s * x.query, x.lam, s * x.prev, tuple((k, e, s * z) for k, e, z in x.bonus))
        if isinstance(x, Dot):
            return Dot(x.kind, s * x.expr)
        raise SpecError(f"cannot scale {_desc(x)}", span)

    @staticmethod
    def dot_times(a, b, span):
        """A dot product times a [V] vector (either side): a term (x^T y) z of the readout."""
        d, z = (a, b) if isinstance(a, Dot) else (b, a)
        if isinstance(z, Val) and z.kind == "V":
            return Out(sp.Integer(0), bonus=((d.kind, d.expr, z.expr),))
        raise SpecError(f"a dot product x^T y is one number per token; lrdsl reads it only in the readout, "
                        f"as a factor of a [V] vector, e.g. o = S_prev^T q + (q^T (u*k)) v; here it meets "
                        f"{_desc(z)}", span)

    def op_matmul(self, a, b, n):
        span = n.span
        if isinstance(a, Gram) or isinstance(b, Gram):
            raise SpecError("the Gram state G is read only through the offline solve: "
                            "o = S^T (G + diag(lamb))^-1 q", span)
        if isinstance(a, Val) and a.kind == "scalar":
            return self.scale(b, a.expr, span)
        if isinstance(b, Val) and b.kind == "scalar" and not isinstance(a, StT):
            return self.scale(a, b.expr, span)
        if isinstance(a, Val) and isinstance(b, Row):
            if a.kind == b.kind and a.kind in ("K", "V"):
                return Mat((("outer", a.expr, b.expr),), a.kind)
            if a.kind == "K" and b.kind == "V":
                return St((), ((a.expr, b.expr),))
            raise SpecError(f"shape mismatch: {_desc(a)} times {_desc(b)} gives a [{a.kind}, {b.kind}] "
                            "matrix; the state is [K, V], so outer products are k k^T ([K, K], in a "
                            "transition from the left), v v^T ([V, V], from the right) or k v^T ([K, V], "
                            "the write)", span)
        if isinstance(a, Row) and isinstance(b, Val) and b.kind != "scalar":
            if a.kind != b.kind:
                raise SpecError(f"x^T y takes two vectors of one length, not a [{a.kind}] and a [{b.kind}] "
                                "vector", span)
            return Dot(a.kind, a.expr * b.expr)
        if isinstance(a, Dot) or isinstance(b, Dot):
            return self.dot_times(a, b, span)
        if isinstance(b, StPrev) or isinstance(a, StPrev) and not a.transposed:
            raise SpecError("S_prev, the state before this token's update, is read only by the readout, as "
                            "S_prev^T x with x a [K] vector", span)
        if isinstance(a, StPrev) and isinstance(b, Val):
            if b.kind == "V":
                raise SpecError("shape mismatch: S_prev^T is [V, K], so it reads a [K] vector (S_prev^T q), "
                                "not a [V] vector", span)
            return Out(sp.Integer(0), prev=b.expr)
        if isinstance(a, Val) and isinstance(b, Val):
            raise SpecError(f"two column vectors side by side ({_desc(a)}, {_desc(b)}); "
                            "did you mean an outer product like k v^T?", span)
        if isinstance(a, Mat) and isinstance(b, Mat):
            return Mat(tuple(self.term_product(s, t, span) for s in a.terms for t in b.terms), _dims(a, b, span))
        if isinstance(a, St) and isinstance(b, Mat):
            return self.right_product(a, b, span)
        if isinstance(a, Mat) and isinstance(b, St):
            if a.dim == "V":
                raise SpecError("shape mismatch: a [V, V] matrix cannot multiply S ([K, V]) from the left; "
                                "value-side factors stand on the right, S N (e.g. S diag(exp(gv)))", span)
            if a.dim == "K" and b.side == "right":  # M (S N): two-sided
                if b.writes:
                    raise SpecError("the write is added after the transition: write M S N + k v^T", span)
                return St(a.terms, (), side="both", right=b.carried)
            if b.side == "both" and not b.writes:  # M' (M S N)
                return St(tuple(self.term_product(s, t, span) for s in a.terms for t in b.carried), (), side="both",
                          right=b.right)
            if any(s[0] == "outer" for s in a.terms) and (b.writes or b.inner):
                if b.side in ("right", "both"):
                    raise SpecError("a product of steps per token with a value-side transition (S N) is not "
                                    "supported yet; write one step per token", span)
                # a factor with an erase after a write: one more step of a product (DeltaProduct),
                # the steps so far its input
                return St(a.terms, (), b.inner + (b,))
            carried = tuple(self.term_product(s, t, span) for s in a.terms for t in b.carried)
            writes = tuple((s[1] * u, z) for s in a.terms for u, z in b.writes)
            return St(carried, writes, b.inner, side="left" if a.dim == "K" else b.side)
        if isinstance(a, Mat) and isinstance(b, Val) and b.kind == "K" and a.dim != "V":
            if any(t[0] == "outer" for t in a.terms):
                raise SpecError("a rank-1 matrix times a vector is a dot product; not supported here", span)
            return Val("K", sum((t[1] for t in a.terms), sp.Integer(0)) * b.expr)
        if isinstance(a, StT) and isinstance(b, GramInv) and not b.after_state:
            return GramInv(b.lam, after_state=True)
        if isinstance(a, GramInv) and isinstance(b, Val) and b.kind in ("K", "scalar"):
            if not a.after_state:
                raise SpecError("(G + diag(lamb))^-1 q is read by the state: write o = S^T (G + diag(lamb))^-1 q",
                                span)
            return Out(b.expr, a.lam)
        if isinstance(a, StT) and isinstance(b, Val):
            if b.kind == "V":
                raise SpecError("shape mismatch: S^T is [V, K], so it reads a [K] vector (S^T q), "
                                "not a [V] vector", span)
            return Out(b.expr)
        if isinstance(a, St) or isinstance(b, Mat) and isinstance(a, (St, Val)):
            raise SpecError(f"shape mismatch: {_desc(a)} times {_desc(b)}; in the update [K, K] factors "
                            "multiply S from the left (M S) and [V, V] factors from the right (S N), "
                            "e.g. S diag(exp(gv)) with gv a [V] vector", span)
        if isinstance(b, St):
            raise SpecError(f"shape mismatch: {_desc(a)} times S; a factor multiplying S from the left "
                            "must be a [K, K] matrix (I, diag(g), k k^T, ...) or a number", span)
        raise SpecError(f"shape mismatch: cannot multiply {_desc(a)} by {_desc(b)}", span)

    def right_product(self, a: St, b: Mat, span) -> St:
        """(carried) S N: the transition multiplies S's rows from the right (the value side)."""
        if b.dim == "K":
            raise SpecError("shape mismatch: S is [K, V], so a factor on its right is a [V, V] matrix "
                            "(diag(gv), v v^T with [V] vectors), not a [K, K] one", span)
        if a.writes or a.inner:
            raise SpecError("the write is added after the transition: write S N + k v^T, not (S + k v^T) N",
                            span)
        if a.side == "left" and b.dim == "V":  # (M S) N: two-sided
            return St(a.carried, (), side="both", right=b.terms)
        if a.side == "both":  # (M S N) N'
            return St(a.carried, (), side="both",
                      right=tuple(self.term_product(t, s, span) for t in a.right for s in b.terms))
        carried = tuple(self.term_product(t, s, span) for t in a.carried for s in b.terms)
        return St(carried, (), side="right" if b.dim == "V" else a.side)

    @staticmethod
    def term_product(s, t, span):
        if s[0] == "diag" and t[0] == "diag":
            return ("diag", s[1] * t[1])
        if s[0] == "diag":
            return ("outer", s[1] * t[1], t[2])
        if t[0] == "diag":
            return ("outer", s[1], s[2] * t[1])
        raise SpecError("the product of two outer products (a c^T)(u w^T) contains the dot product c^T u; "
                        "lrdsl compiles one rank-1 erase per step: (I - a c^T) D S + u z^T, or several steps "
                        "per token written nested, (I - a2 c2^T) ((I - a1 c1^T) D S + u1 z1^T) + u2 z2^T", span)

    # -- statements
    def declare(self, name, kind, span, what):
        check_name(name, span, what)
        if name in self.kinds:
            raise SpecError(f"'{name}' is already defined (line {self.defined_at[name].line}); "
                            "choose another name", span)
        self.kinds[name] = kind
        self.symbols[name] = ir.symbol(name)
        self.defined_at[name] = span


def _dims(a: Mat, b: Mat, span) -> str:
    """The dimension of a sum or product of two matrices: "" (a multiple of I) takes the other's."""
    if a.dim and b.dim and a.dim != b.dim:
        raise SpecError("cannot combine a [K, K] and a [V, V] matrix: [K, K] factors multiply S from the "
                        "left, [V, V] ones from the right", span)
    return a.dim or b.dim


def _sides(a: St, b: St, span) -> str:
    if "both" in (a.side, b.side) and a.carried and b.carried:
        raise SpecError("a sum of transitions with a two-sided one (M S N + ...) is not one product; lrdsl "
                        "compiles M S N + k v^T with M and N each diagonal plus rank 1", span)
    if a.side and b.side and a.side != b.side:
        raise SpecError("the update adds a transition from the left (M S) to one from the right (S N); "
                        "lrdsl compiles one of the two forms, M S + k v^T or S N + k v^T", span)
    return a.side or b.side


def lower(spec: Spec) -> ir.Mixer:
    """AST (either form) -> IR. Raises SpecError naming the place of the first problem."""
    check_name(spec.name, spec.span, "mixer name")
    if spec.name in sys.stdlib_module_names or spec.name in ("lrdsl", "numpy", "sympy", "jinja2", "lark"):
        # `lrdsl compile` writes <mixer name>.py: it must not shadow a module on the import path
        raise SpecError(f"the mixer name '{spec.name}' is the name of a Python module, and `lrdsl "
                        "compile` writes <mixer name>.py; choose another name", spec.span)
    spec = desugar(spec)
    lw = Lowerer()
    inputs, aux, lets, params = [], [], [], []
    inlined = {}  # let name -> its expression in inputs and states (sympy folds what it can)
    readout = None
    allow = set()
    for st in spec.statements:
        if isinstance(st, Inputs):
            for d in st.decls:
                inputs.append(_input(lw, d))
        elif isinstance(st, Params):
            params += lower_params(lw, st)
        elif isinstance(st, StateDecl):
            kind, kspan = st.shape
            if kind not in ("K", "V"):
                raise SpecError(f"an auxiliary state is indexed by K or V, not '{kind}'", kspan)
            lw.declare(st.name, kind, st.span, "state name")
            aux.append(_aux(lw, st, kind, lets))
        elif isinstance(st, Let):
            val = lw.expr(st.expr)
            if not isinstance(val, Val):
                raise SpecError(f"a let names an elementwise value; this one is {_desc(val)}", st.span)
            uses = {s: inlined[s.name] for s in val.expr.free_symbols if s.name in inlined}
            inlined[st.name] = val.expr.xreplace(uses)
            depth = inlined_depth(inlined[st.name])
            if depth > MAX_INLINED_DEPTH:
                raise SpecError(f"with the lets it uses substituted, this expression nests {depth} levels "
                                f"deep; lrdsl analyses at most {MAX_INLINED_DEPTH}: write the chain in fewer "
                                "steps", st.span)
            lw.declare(st.name, val.kind, st.span, "let name")
            lets.append(ir.Let(st.name, val.kind, val.expr, st.span))
        elif isinstance(st, Update):
            pass  # one line, or several in a row for a product of steps: composed below
        elif isinstance(st, Readout):
            if readout is not None:
                raise SpecError("the readout o = ... is given twice", st.span)
            readout = st
        elif isinstance(st, Allow):
            if st.what not in ALLOWS:
                raise SpecError(f"unknown allowance '{st.what}'; the allowances are `allow unstable` and "
                                "`allow ill_conditioned`", st.span)
            allow.add(st.what)
    for need, kind in (("q", "K"), ("k", "K"), ("v", "V")):
        got = next((i for i in inputs if i.name == need), None)
        if got is None or got.kind != kind:
            raise SpecError(f"every mixer has the inputs q[K], k[K] and v[V]; "
                            f"{'declare' if got is None else 'fix'} `input {need}[{kind}]`",
                            got.span if got else spec.span)
    if not any(isinstance(st, Update) for st in spec.statements):
        raise SpecError("the spec has no update of the state; add a line like `S = S + k v^T`", spec.span)
    if readout is None:
        raise SpecError("the spec has no readout; add the line `o = S^T q`", spec.span)
    update, product_span = compose(lw, spec.statements)
    decay, delta, write, steps, side, n = transition(lw, update)
    out = lw.expr(readout.expr)
    check_readout(lw, out, delta, readout.span)
    bonus = tuple(ir.Bonus(k, e, z) for k, e, z in out.bonus if simplified(e) != 0 and simplified(z) != 0)
    check_before_terms(out, aux, lets, readout.span)
    m = ir.Mixer(spec.name, tuple(inputs), tuple(aux), tuple(lets), decay, delta, write, out.query,
                 "unstable" in allow, solve_lam=out.lam, params=tuple(params), update_span=update.span,
                 readout_span=readout.span, allow_ill_conditioned="ill_conditioned" in allow,
                 query_prev=out.prev, bonus=bonus, steps=steps, side=side, n_decay=n[0] if n else None,
                 n_delta=n[1] if n else None)
    check_product(m, product_span)
    if side != "left":
        check_value_side(m, update.span, readout.span)
    check_constants(m, update.span)
    return m


def _input(lw: Lowerer, d) -> ir.Input:
    kind = "scalar"
    if d.shape is not None:
        kind, kspan = d.shape
        if kind not in ("K", "V"):
            raise SpecError(f"an input is indexed by K (key channels) or V (value channels), not '{kind}'",
                            kspan)
    lw.declare(d.name, kind, d.span, "input name")
    attrs = set(d.attrs)
    if len(attrs) != len(d.attrs):
        raise SpecError(f"input '{d.name}' repeats an attribute", d.span)
    if attrs & {"unit", "l2norm"} and kind == "scalar":
        raise SpecError(f"'{d.name}' is one number per head; unit and l2norm apply to vectors", d.span)
    if {"unit", "l2norm"} <= attrs:
        raise SpecError(f"'{d.name}': l2norm already makes it unit; keep one of the two", d.span)
    lo, hi, lo_open, hi_open = -sp.oo, sp.oo, True, True
    if "log" in attrs:
        if d.range is not None:
            raise SpecError(f"'{d.name}' is a log-decay (<= 0); give either `log` or a range", d.range.span)
        hi, hi_open = sp.Integer(0), False
    if d.range is not None:
        lo, hi, lo_open, hi_open = declared_range(d)
    if "l2norm" in attrs or "unit" in attrs:
        lo, hi, lo_open, hi_open = sp.Integer(-1), sp.Integer(1), False, False
    shared = "shared" in attrs or d.name in ("q", "k")
    return ir.Input(d.name, kind, shared, "l2norm" in attrs, bool(attrs & {"unit", "l2norm"}),
                    "log" in attrs, lo, hi, lo_open, hi_open, d.span)


def _aux(lw: Lowerer, st: StateDecl, kind: str, lets) -> ir.Aux:
    val = lw.expr(st.expr)
    for lt in reversed(lets):  # inline lets: a state then depends only on inputs and earlier states
        val = Val(val.kind, val.expr.xreplace({ir.symbol(lt.name): lt.expr})) if isinstance(val, Val) else val
    p = lw.symbols[st.name]
    if not isinstance(val, Val) or val.kind not in (kind, "scalar"):
        raise SpecError(f"state {st.name}[{kind}] must be updated by a [{kind}] vector expression, "
                        f"not {_desc(val)}", st.span)
    e = sp.expand(val.expr)
    decay = sp.diff(e, p)
    write = simplified(e - decay * p)
    if decay.has(p) or write.has(p):
        raise SpecError(f"state {st.name} must be first order: {st.name} = a * {st.name} + b with a and b "
                        f"free of {st.name}", st.span)
    return ir.Aux(st.name, kind, sp.factor_terms(decay), write, st.span)
