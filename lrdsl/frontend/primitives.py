"""The elementwise primitives: one table, read by every stage, so that a new function is one entry.

Each entry gives its spec name, its sympy form (what the front end builds from the call), the
sympy class of the IR node it leaves (None where the form is built from other primitives, as
sigmoid(x) = 1/(1 + exp(-x)) is), the range rule the checker uses (intervals of the arguments ->
an interval enclosing the values), the torch function the reference calls, the Triton text the
kernels use (numerically stable over float32's whole range), the printed form (`lrdsl show`
re-parses it to the same IR) and the derivative (sympy's own for sympy's classes; the entry's for
the classes defined here, through their fdiff, so that sympy.diff and the generated chain rule
see it). Entries without a spec name are nodes that only derivatives produce (sign, Heaviside).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import sympy as sp

from lrdsl.frontend import ir

INF = float("inf")
FULL = (-INF, INF)


def _sigmoid(x):
    return 1 / (1 + sp.exp(-x))


class _Elementwise(sp.Function):
    """A primitive sympy does not have: numbers fold to the elementary definition, and the
    derivative comes from the table."""
    nargs = 1

    @classmethod
    def eval(cls, x):
        if x.is_number:
            return cls.definition(x)

    def fdiff(self, argindex=1):
        return BY_CLASS[type(self)].derivative(*self.args)

    def _eval_is_extended_real(self):
        return self.args[0].is_extended_real


class softplus(_Elementwise):
    """log(1 + exp(x)): a positive rate (Mamba's dt), computed as log1p(exp(-|x|)) + max(x, 0)."""

    @staticmethod
    def definition(x):
        return sp.log(1 + sp.exp(x))

    def _eval_is_positive(self):
        return True if self.args[0].is_extended_real else None


class log1p(_Elementwise):
    """log(1 + x), accurate for small x."""

    @staticmethod
    def definition(x):
        return sp.log(1 + x)


class silu(_Elementwise):
    """x sigmoid(x)."""

    @staticmethod
    def definition(x):
        return x * _sigmoid(x)


class gate(sp.Function):
    """gate(p, x): x where p > 0, else 0 (x not read there, so -inf or nan in x gives 0). The split
    spec (lrdsl/codegen/split.py) switches the decay off in one phase with it: p * log(d) would be nan
    where log(d) is -inf, a reset. Not in the spec language."""
    nargs = 2

    @classmethod
    def eval(cls, p, x):
        if p.is_number:
            return x if p > 0 else sp.Integer(0)
        if x == 0:
            return sp.Integer(0)

    def fdiff(self, argindex=1):
        return sp.Integer(0) if argindex == 1 else gate(self.args[0], sp.Integer(1))

    def _eval_is_extended_real(self):
        return self.args[1].is_extended_real


# ---- range rules: intervals of the arguments -> an interval enclosing the values ---------------
def monotone(f, lo_limit=None, hi_limit=None):
    """The rule of a non-decreasing function of one argument (f at the ends, its limits at +-inf)."""
    def at(x):
        return lo_limit if x == -INF and lo_limit is not None else hi_limit if x == INF and hi_limit is not None \
            else f(x)
    return lambda a: (at(a[0]), at(a[1]))


def _exp(x):
    return math.exp(x) if x < 700 else INF


def _log_rule(a, shift=0.0):  # log(x + shift): nan below -shift, so the whole line there
    lo, hi = a[0] + shift, a[1] + shift
    return FULL if hi <= 0 else (math.log(lo) if lo > 0 else -INF, math.log(hi))


def _abs_rule(a):
    lo, hi = a
    return (lo, hi) if lo >= 0 else (-hi, -lo) if hi <= 0 else (0.0, max(-lo, hi))


def _softplus(x):
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _silu(x):
    return 0.0 if x == -INF else x * 0.5 * (1 + math.tanh(x / 2))


SILU_ARGMIN = float(-1 - sp.LambertW(sp.exp(-1)))  # where 1 + x (1 - sigmoid(x)) = 0
SILU_MIN = SILU_ARGMIN + 1  # silu there is x + 1


def _silu_rule(a):
    lo, hi = a
    if hi <= SILU_ARGMIN:
        return _silu(hi), _silu(lo)
    if lo >= SILU_ARGMIN:
        return _silu(lo), _silu(hi)
    return SILU_MIN, max(_silu(lo), _silu(hi))


def _squash_rule(p, x, center):
    return (1 / x[1], x[1]) if x[0] == x[1] and x[1] >= 1 else FULL  # m lies in (1/x, x) whatever P is


def _heaviside_rule(a, h0=(0.5, 0.5)):
    step = lambda x: 0.0 if x < 0 else 1.0 if x > 0 else h0[0]  # noqa: E731
    return step(a[0]), step(a[1])


# ---- Triton texts (arguments already lowered to text) ---------------------------------------------
def _log1p_text(x):
    # log(u) * x / (u - 1) with u = 1 + x (rounded) cancels the rounding of 1 + x (Goldberg)
    u = f"(1.0 + {x})"
    return f"tl.where({u} == 1.0, {x}, tl.log({u}) * {x} / tl.where({u} == 1.0, 1.0, {u} - 1.0))"


def _tanh_text(x):
    # (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1]: no overflow at either end, but 1 - e cancels
    # for small |x|, where the series x - x^3/3 + 2x^5/15 is exact to float32 (|x| < 0.1)
    e = f"tl.exp(-2.0 * tl.abs({x}))"
    series = f"{x} * (1.0 + {x} * {x} * (-0.3333333333333333 + 0.13333333333333333 * {x} * {x}))"
    return f"tl.where(tl.abs({x}) < 0.1, {series}, tl.where({x} < 0, -1.0, 1.0) * (1.0 - {e}) / (1.0 + {e}))"


def _fold(fn):
    return lambda *xs: xs[0] if len(xs) == 1 else f"{fn}({xs[0]}, {_fold(fn)(*xs[1:])})"


@dataclass(frozen=True)
class Primitive:
    name: str  # in the spec language ("" for nodes only derivatives produce)
    arity: int  # number of arguments; 0: two or more
    form: Callable  # sympy arguments -> the IR's expression
    cls: type | None = None  # class of the IR node; None where form is built from other entries
    range: Callable | None = None  # argument intervals -> enclosing interval
    torch: Callable | None = None  # tensors (or floats) -> tensor
    triton: Callable | None = None  # argument texts -> text; None: lowered through `expand`
    printed: Callable | None = None  # argument texts -> spec text; None: name(args)
    derivative: Callable | None = None  # arguments -> d/dx (classes defined here); None: sympy's own
    expand: Callable | None = None  # node -> an equivalent expression of other entries
    numpy: Callable | None = None  # arrays -> array, for the checker's witnesses; None: lambdify's own
    params: str = "x"  # the arguments, as error messages and docs/language.md show them


def _np():
    import numpy
    return numpy


def _torch():  # imported on first use: the front end and the checker run without torch
    import torch
    return torch


def _T(x, **kw):
    return _torch().as_tensor(x, **kw)


def _tf(name):
    """torch.<name>, or torch.nn.functional.<name>, applied to tensors or floats."""
    def call(*xs):
        t = _torch()
        return (getattr(t, name, None) or getattr(t.nn.functional, name))(*map(_T, xs))
    return call


def _softplus_torch(x):  # torch's own softplus returns x above a threshold (20): not exact in float64
    x = _T(x)
    return _torch().clamp(x, min=0) + _torch().log1p(_torch().exp(-x.abs()))


TABLE = (
    Primitive("exp", 1, sp.exp, sp.exp, lambda a: (_exp(a[0]), _exp(a[1])), _tf("exp"),
              lambda x: f"tl.exp({x})"),
    Primitive("log", 1, sp.log, sp.log, _log_rule, _tf("log"), lambda x: f"tl.log({x})"),
    Primitive("sqrt", 1, sp.sqrt),  # a power 1/2, printed and lowered as powers are
    Primitive("abs", 1, sp.Abs, sp.Abs, _abs_rule, _tf("abs"), lambda x: f"tl.abs({x})"),
    Primitive("sigmoid", 1, _sigmoid),
    Primitive("softplus", 1, softplus, softplus, monotone(_softplus, 0.0, INF),
              _softplus_torch,
              lambda x: f"({_log1p_text(f'tl.exp(-tl.abs({x}))')} + tl.maximum({x}, 0.0))",
              derivative=_sigmoid, numpy=lambda x: _np().logaddexp(0.0, x)),
    Primitive("log1p", 1, log1p, log1p, lambda a: _log_rule(a, 1.0), _tf("log1p"), _log1p_text,
              derivative=lambda x: 1 / (1 + x), numpy=lambda x: _np().log1p(x)),
    Primitive("tanh", 1, sp.tanh, sp.tanh, monotone(math.tanh), _tf("tanh"), _tanh_text),
    Primitive("silu", 1, silu, silu, _silu_rule, _tf("silu"), lambda x: f"({x} / (1.0 + tl.exp(-{x})))",
              derivative=lambda x: _sigmoid(x) * (1 + x * (1 - _sigmoid(x))),
              numpy=lambda x: x / (1 + _np().exp(-x))),
    Primitive("max", 0, sp.Max, sp.Max, lambda *a: (max(x[0] for x in a), max(x[1] for x in a)),
              lambda *xs: _reduce("maximum", xs), _fold("tl.maximum"), params="x, y, ..."),
    Primitive("min", 0, sp.Min, sp.Min, lambda *a: (min(x[0] for x in a), min(x[1] for x in a)),
              lambda *xs: _reduce("minimum", xs), _fold("tl.minimum"), params="x, y, ..."),
    Primitive("clamp", 3, lambda x, lo, hi: sp.Min(sp.Max(x, lo), hi), params="x, lo, hi"),
    Primitive("squash", 3, ir.squash, ir.squash, _squash_rule,
              printed=lambda p, x, c: f"squash({p}, x = {x}, center = {c})", expand=lambda e: e.definition(),
              params="P, x = 1.5, center = -0.2"),
    # nodes of derivatives: d|x| = sign(x), d max(x, y)/dx = Heaviside(x - y) (1/2 at a tie)
    Primitive("", 1, sp.sign, sp.sign, monotone(lambda x: float((x > 0) - (x < 0)), -1.0, 1.0),
              _tf("sign"), lambda x: f"tl.where({x} > 0, 1.0, tl.where({x} < 0, -1.0, 0.0))"),
    Primitive("", 2, sp.Heaviside, sp.Heaviside, _heaviside_rule,
              lambda x, h0=0.5: _torch().heaviside(_T(x), _T(h0, dtype=_T(x).dtype)),
              lambda x, h0="0.5": f"tl.where({x} > 0, 1.0, tl.where({x} < 0, 0.0, {h0}))"),
    # the split spec's phase gate (lrdsl/codegen/split.py)
    Primitive("", 2, gate, gate, lambda p, x: (min(x[0], 0.0), max(x[1], 0.0)),
              lambda p, x: _torch().where(_T(p) > 0, _T(x), _T(0.0, dtype=_T(x).dtype)),
              lambda p, x: f"tl.where({p} > 0, {x}, 0.0)", printed=lambda p, x: f"gate({p}, {x})",
              numpy=lambda p, x: _np().where(p > 0, x, 0.0)),
)


def _reduce(name, xs):
    torch = _torch()
    fn = getattr(torch, name)
    t = next((x for x in xs if torch.is_tensor(x)), None)  # constants take its dtype and device
    xs = [x if torch.is_tensor(x) else _T(x, dtype=None if t is None else t.dtype, device=None if t is None
                                           else t.device) for x in xs]
    acc = xs[0]
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc


BY_NAME = {p.name: p for p in TABLE if p.name}
BY_CLASS = {p.cls: p for p in TABLE if p.cls is not None}
NAMES = tuple(BY_NAME)  # what a spec may call (plus diag, which builds a matrix)


def of(e) -> Primitive | None:
    """The entry of an IR node, or None (symbols, numbers, +, *, ^)."""
    return BY_CLASS.get(type(e))


def expanded(e: sp.Expr) -> sp.Expr:
    """e with the entries that have no lowering of their own (squash) replaced by their expansions."""
    return sp.sympify(e).replace(lambda x: (of(x) or TABLE[0]).expand is not None, lambda x: of(x).expand(x))


def inlined(m: ir.Mixer, e: sp.Expr) -> sp.Expr:
    """e over m's inputs only: lets substituted (latest first), squash by its definition."""
    return expanded(m.inline_lets(e))


# the numpy functions of the classes defined here, by name, for sympy.lambdify (the checker's witnesses)
NUMPY = {p.cls.__name__: p.numpy for p in TABLE if p.numpy is not None}
