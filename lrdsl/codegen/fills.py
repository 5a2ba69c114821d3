"""The finite copies' rule, per input, from the spec alone (no torch): which entries of an input the
staged backward takes as non-finite and what finite value stands in for them. runtime/nonfinite.py
makes the copies and flags by it; codegen/finite.py pastes it into the backward's loads."""
from __future__ import annotations

import dataclasses
import functools
import math

import sympy as sp

from lrdsl.frontend.ir import log_of


def fill_value(i) -> float:
    """A finite value inside input i's declared range (not at an open end: the offline solve's
    regulariser is refused there)."""
    lo = float(i.lo) if i.lo.is_finite else -math.inf
    hi = float(i.hi) if i.hi.is_finite else math.inf
    if math.isfinite(lo) and math.isfinite(hi):
        return (lo + hi) / 2
    if math.isfinite(lo):
        return lo + 1.0
    if math.isfinite(hi):
        return hi - 1.0
    return 0.0


@functools.lru_cache(maxsize=256)  # a sympy pass (~0.1 ms) that every backward would repeat
def resets(mixer_ir) -> frozenset:
    """The inputs whose -inf is a reset, not a bad entry: every `log` input, and every input that is
    a per-token log-decay itself, whatever its declared range, and enters nothing else: the state's
    (`exp(g)`, `diag(exp(w))`) or an auxiliary state's of one number per head (`p = exp(g) p + ...`).
    The chunked kernels floor those log-decays (plan._floored, plan._aux_log_decay) and the chain
    rule gives them a zero gradient below the floor, as the reference's exp(-inf) = 0 has it; a
    finite fill in its place would be a decay near 1 instead of 0, and the gradients finite wrong
    numbers. (Elsewhere, `g k v^T` say, -inf is a non-finite input as any other.)"""
    m = mixer_ir
    kinds = m.kinds()
    decays, rest = [], []
    if m.decay.kind in ("scalar", "diagonal"):
        decays.append(m.log_decay())
    else:
        rest.append(m.decay)
    for a in m.aux:
        if all(kinds[s.name] == "scalar" for s in m.inline_lets(a.decay).free_symbols):
            decays.append(log_of(m.inline_lets(a.decay)))
        else:
            rest.append(a.decay)
        rest.append(a.write)
    rest += [getattr(m, f.name) for f in dataclasses.fields(m) if f.name not in ("inputs", "params", "aux", "lets", "decay")]
    used = set().union(*(m.inline_lets(e).free_symbols for e in exprs(rest)))
    return frozenset(i.name for i in m.inputs
                     if i.log or (i.symbol not in used and any(m.inline_lets(d) == i.symbol for d in decays)))


def exprs(x):
    """Every sympy expression inside x (dataclasses, tuples and lists of them, or expressions)."""
    if isinstance(x, sp.Basic):
        yield x
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            yield from exprs(getattr(x, f.name))
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from exprs(y)


def bad_ends(i, reset: bool) -> tuple:
    """(+inf is bad, -inf is bad) for input i: a clamp into a finite end makes that infinity finite,
    and -inf in a log-decay is a reset (`reset`: i is one of resets')."""
    clamped = i.clamped
    return not (clamped and i.hi.is_finite), not (clamped and i.lo.is_finite) and not reset


def load_rule(i, reset: bool) -> tuple:
    """(fill, +inf is bad, -inf is bad) of input i: the finite copy's rule, which the staged backward's
    loads apply themselves (codegen/finite.py)."""
    return (fill_value(i), *bad_ends(i, reset))
