"""Several update lines in a row -> the one nested update they mean (issue 40).

    S = (I - b1 k k^T) exp(g) S + b1 k v^T
    S = (I - b2 k2 k2^T) S + b2 k2 v2^T

applies the lines in order within one token: each later line's S is the line above's result, so
the two lines are S = (I - b2 k2 k2^T) ((I - b1 k k^T) exp(g) S + b1 k v^T) + b2 k2 v2^T, the
nested form of a product of steps (DeltaProduct). The lines are composed here, on the syntax tree,
into that nested update, which lowers as if it were written so: one IR, and `lrdsl show` prints the
nested form. Each later line is checked alone first, so a mistake points at its own line.
"""
from __future__ import annotations

import dataclasses

from lrdsl.errors import Span, SpecError
from lrdsl.frontend.syntax import BinOp, Call, Neg, Readout, Transpose, Update, Var
from lrdsl.frontend.transition import canonical
from lrdsl.frontend.values import St
from lrdsl.frontend.values import describe as _desc

STEP_FORM = "S = (I - a c^T) S + u z^T"


def compose(lw, statements) -> tuple:
    """(update, product_span): the spec's one update (several in a row composed into the nested
    form; its span runs from the first line to the last) and where to report what the product as a
    whole does not take (the second update line; the update itself for one line)."""
    at = [i for i, s in enumerate(statements) if isinstance(s, Update)]
    first = statements[at[0]]
    if len(at) == 1:
        return first, first.span
    expr, steps = first.expr, _n_steps(lw.expr(first.expr))
    for prev, i in zip(at, at[1:]):
        st = statements[i]
        steps = _check_step(lw, st, steps)
        between = statements[prev + 1:i]
        if any(isinstance(s, Readout) for s in between):
            raise SpecError("this update comes after the readout o = ...; a product's update lines stand in "
                            "a row before the readout: move it up under the previous S = ... line", st.span)
        if between:
            raise SpecError("the update lines of a product of steps stand in a row, applied in order; move "
                            "this line up under the previous S = ... line", st.span)
        expr = _substitute(st.expr, expr)
    last = statements[at[-1]].span
    span = Span(first.span.line, first.span.column, last.end_line, last.end_column)
    return Update(expr, span), statements[at[1]].span


def _n_steps(val) -> int:
    return 1 + len(val.inner) if isinstance(val, St) else 1


def _check_step(lw, st: Update, before: int) -> int:
    """A later line alone is one step (or a nested product of steps) applied to S: once, linearly,
    no decay, with an erase and a write. Returns the steps so far with it."""
    uses = _count_s(st.expr)
    if uses != 1:
        how = "does not use S" if uses == 0 else f"uses S {uses} times"
        raise SpecError(f"this update line {how}; an update line after the first is the next step of a "
                        f"product, applied once to the S the line above gives: {STEP_FORM}", st.span)
    val = lw.expr(st.expr)
    if not isinstance(val, St):
        raise SpecError(f"this update line is not linear in S (it is {_desc(val)}); an update line after the "
                        f"first is the next step of a product: {STEP_FORM}", st.span)
    if val.side in ("right", "both"):
        raise SpecError("a product of steps per token with a value-side transition (S N) is not supported "
                        "yet; write one step per token", st.span)
    if val.inner:  # itself a nested product: its steps are checked when the whole is lowered
        return before + _n_steps(val)
    decay, delta = canonical(lw, val.carried, st.span, "left")
    i = before + 1
    if decay.kind != "identity":
        raise SpecError(f"step {i} of the product has a decay ({decay.value}); lrdsl takes one decay per token, "
                        "on the first step: move it to the first update line, next to S, as in "
                        "S = (I - a1 c1^T) exp(g) S + u1 z1^T", st.span)
    if delta is None:
        raise SpecError("S is updated twice without an erase between; a spec has one update line, or several "
                        f"in a row for a product of steps, each after the first of the form {STEP_FORM}",
                        st.span)
    if not val.writes:
        raise SpecError(f"step {i} of the product has no write term; each step is {STEP_FORM}", st.span)
    return i


def _count_s(node) -> int:
    if isinstance(node, Var):
        return node.name == "S"
    if isinstance(node, Call):
        return sum(_count_s(a) for a in (*node.args, *(v for _, v in node.kwargs)))
    if isinstance(node, BinOp):
        return _count_s(node.lhs) + _count_s(node.rhs)
    if isinstance(node, (Neg, Transpose)):
        return _count_s(node.x)
    return 0


def _substitute(node, inner):
    """node with its S replaced by the expression `inner` (the tree keeps the grouping)."""
    if isinstance(node, Var):
        return inner if node.name == "S" else node
    if isinstance(node, Call):
        return dataclasses.replace(node, args=tuple(_substitute(a, inner) for a in node.args),
                                   kwargs=tuple((n, _substitute(v, inner)) for n, v in node.kwargs))
    if isinstance(node, BinOp):
        return dataclasses.replace(node, lhs=_substitute(node.lhs, inner), rhs=_substitute(node.rhs, inner))
    if isinstance(node, (Neg, Transpose)):
        return dataclasses.replace(node, x=_substitute(node.x, inner))
    return node
