"""Checks of a lowered spec as a whole: its readout's form, and what a product of steps, a value-side
transition and the readout's terms before the update do not combine with yet; each refused where
it is written."""
from __future__ import annotations

import sympy as sp

from lrdsl.errors import SpecError
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified
from lrdsl.frontend.values import Out
from lrdsl.frontend.values import describe as _desc


def check_readout(lw, out, delta, span) -> None:
    """The readout is o = S^T x (and S_prev^T y, dot products) or the offline solve's, each as it may be."""
    if not isinstance(out, Out):
        raise SpecError(f"the readout must read the state as o = S^T x with x a [K] vector; "
                        f"this is {_desc(out)}", span)
    if simplified(out.query) == 0 and simplified(out.prev) == 0:
        raise SpecError("the readout must read the state: add S^T x or S_prev^T x (x a [K] vector), "
                        "e.g. o = S^T q", span)
    if out.lam is not None and (out.prev != 0 or out.bonus):
        raise SpecError("the offline solve's readout is o = S^T (G + diag(lamb))^-1 q alone; it takes no "
                        "S_prev^T or dot-product terms", span)
    if out.lam is not None:
        if delta is not None:
            raise SpecError("the offline solve (o = S^T (G + diag(lamb))^-1 q) goes with a transition without "
                            "erase: S = D S + u v^T, its Gram state G = D G + u k^T", span)
        if out.lam == 0:
            raise SpecError("the solve needs a regulariser: o = S^T (G + diag(lamb))^-1 q with lamb > 0",
                            span)
        if any(lw.kinds.get(str(sym)) == "V" for sym in out.lam.free_symbols):
            raise SpecError("the regulariser of the solve runs over key channels (K), not value channels",
                            span)


def check_value_side(m: ir.Mixer, span, readout_span) -> None:
    """What a value-side transition (S N) does not combine with yet: each refused where it is written."""
    if m.aux:
        raise SpecError("auxiliary states with a value-side transition (S N) are not supported yet; "
                        "compute the per-token quantities from inputs and lets", m.aux[0].span)
    if m.solve_lam is not None or m.reads_before:
        raise SpecError("a value-side transition (S N) reads out as o = S^T x alone: S_prev^T, dot-product "
                        "terms and the offline solve are not supported with it yet", readout_span)


def check_product(m: ir.Mixer, span) -> None:
    """What a product of steps per token does not take yet: each is refused with the reason."""
    if not m.steps:
        return
    why = ("auxiliary states (they would advance once per step)" if m.aux else
           "an offline solve" if m.solve_lam is not None else
           "readout terms beside S^T x (S_prev^T y, dot products)" if m.reads_before else "")
    if why:
        raise SpecError(f"a product of {m.n_steps} steps per token does not take {why} yet; write one step "
                        "per token, or drop them", span)


def check_before_terms(out: Out, aux, lets, span) -> None:
    """S_prev^T y and the dot products run outside the kernels (codegen/readouts.py), where the
    auxiliary states are not at hand: they may read inputs, params and lets of those only."""
    if not aux:
        return
    inlined = {}
    for lt in lets:
        inlined[ir.symbol(lt.name)] = lt.expr.xreplace(inlined)
    states = {ir.symbol(a.name) for a in aux}
    for e in (out.prev, *(x for _, s, z in out.bonus for x in (s, z))):
        used = sp.sympify(e).xreplace(inlined).free_symbols & states
        if used:
            raise SpecError(f"S_prev^T y and dot-product terms of the readout may not read an auxiliary state "
                            f"({', '.join(sorted(map(str, used)))}); read it through S^T x, or write the term "
                            "from inputs, params and lets of those", span)
