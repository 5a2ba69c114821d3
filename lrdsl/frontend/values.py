"""The typed values of the explicit form as lower.py builds them: an elementwise value, a row
vector, a K x K matrix (a sum of diag(d) and u c^T terms), a [K, V] state expression, S^T, the
readout and the offline solve's Gram terms."""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp


@dataclass(frozen=True)
class Val:  # elementwise: kind "scalar" | "K" | "V"
    kind: str
    expr: sp.Expr


@dataclass(frozen=True)
class Row:  # a transposed vector
    kind: str
    expr: sp.Expr


@dataclass(frozen=True)
class Mat:  # K x K (dim "K"), V x V (dim "V") or the identity's either (dim ""): ("diag", d) | ("outer", u, c)
    terms: tuple
    dim: str = "K"


@dataclass(frozen=True)
class St:  # [K, V]: carried terms (Mat terms multiplying S) and writes ((u, z), ...)
    carried: tuple
    writes: tuple
    # earlier steps of a product (DeltaProduct): St values, innermost first; where there are any,
    # carried multiplies the state after them, not S itself
    inner: tuple = ()
    # which side the carried terms multiply S from: "left" (M S, [K, K] terms), "right" (S N, [V, V]
    # terms), "both" (M S N: carried M's terms, right N's), "" while they are numbers times I (plain S)
    side: str = ""
    right: tuple = ()


@dataclass(frozen=True)
class StT:  # S^T
    pass


@dataclass(frozen=True)
class StPrev:  # S_prev (transposed: StPrev(True)), the state before this token's update
    transposed: bool = False


@dataclass(frozen=True)
class Dot:  # x^T y: one number per head and token, the sum over channels of `kind` of expr
    kind: str
    expr: sp.Expr


@dataclass(frozen=True)
class Out:  # S^T x + S_prev^T y + sum of (x_i^T y_i) z_i, or S^T (G + diag(lam))^-1 x
    query: sp.Expr
    lam: sp.Expr | None = None
    prev: sp.Expr = sp.Integer(0)
    bonus: tuple = ()  # (kind, summand, value): (sum over kind's channels of summand) * value


@dataclass(frozen=True)
class Gram:  # G + diag(lam): the Gram state of an offline solve, plus a diagonal
    lam: sp.Expr


@dataclass(frozen=True)
class GramInv:  # (G + diag(lam))^-1, or S^T (G + diag(lam))^-1 when after_state
    lam: sp.Expr
    after_state: bool = False


def describe(x) -> str:
    """What a value is, in the words of an error message."""
    if isinstance(x, Val):
        return {"scalar": "a number per head", "K": "a [K] vector", "V": "a [V] vector"}[x.kind]
    if isinstance(x, Row):
        return f"a transposed [{x.kind}] vector"
    if isinstance(x, Mat):
        return "a [V, V] matrix" if x.dim == "V" else "a [K, K] matrix"
    if isinstance(x, St):
        return "a [K, V] state expression"
    if isinstance(x, StT):
        return "S^T"
    if isinstance(x, Gram):
        return "the Gram state G plus a diagonal"
    if isinstance(x, GramInv):
        return "an inverse of G + diag(...)"
    if isinstance(x, StPrev):
        return "S_prev^T" if x.transposed else "S_prev"
    if isinstance(x, Dot):
        return "a dot product (one number per token)"
    return "the readout S^T x"
