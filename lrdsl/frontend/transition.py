"""The update S = M S + u z^T (or S = S N + u z^T, the value side), lowered: the transition's decay and rank-1 erase in canonical form
(I - a c^T) D, D (I - a c^T) or D - a c^T, and the write. Terms are expanded by the lowering's
values (values.py); this module reads them back as one diagonal, at most one rank-1 erase and one
rank-1 write, or refuses with the form it found."""
from __future__ import annotations

import sympy as sp

from lrdsl.errors import SpecError
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified
from lrdsl.frontend.syntax import Update
from lrdsl.frontend.values import St
from lrdsl.frontend.values import describe as _desc


def transition(lw, update: Update):
    """(decay, delta, write, steps, side, n): the first step of the token's update (M's, or on the
    value side N's, canonical decay and erase, and the write), the steps after it (ir.Step, none for
    a single step), the side ("left", "right" or "both") and, for a two-sided M S N, N's (decay, delta)."""
    val = lw.expr(update.expr)
    if not isinstance(val, St):
        raise SpecError(f"the update must be a [K, V] expression in S, like M S + k v^T; this is "
                        f"{_desc(val)}", update.span)
    span = update.span
    if val.side in ("right", "both"):
        if val.inner:
            raise SpecError("a product of steps per token with a value-side transition (S N) is not "
                            "supported yet; write one step per token", span)
        if not val.carried:
            raise SpecError("the update forgets S entirely; write the transition, e.g. S = exp(g) S + k v^T", span)
        decay, delta = canonical(lw, val.carried, span, "right" if val.side == "right" else "left")
        n = canonical(lw, val.right, span, "right") if val.side == "both" else None
        return decay, delta, _write(lw, val, span), (), val.side, n
    if not val.inner:
        return (*_step(lw, val, span), (), "left", None)
    first, *rest = val.inner + (St(val.carried, val.writes),)
    decay, delta, write = _step(lw, first, span, "the first step")
    steps = []
    for i, st in enumerate(rest, 2):
        d, dl, w = _step(lw, st, span, f"step {i}")
        if d.kind != "identity":
            raise SpecError(f"step {i} of the product has a decay ({d.value}); lrdsl takes one decay per token, "
                            "on the first step: move it inside, next to S, as in "
                            "(I - a2 c2^T) ((I - a1 c1^T) exp(g) S + u1 z1^T) + u2 z2^T", span)
        steps.append(ir.Step(dl, w))
    return decay, delta, write, tuple(steps), "left", None


def _step(lw, val: St, span, which: str = ""):
    """One step's (decay, delta, write) from its carried terms and writes."""
    if which and not val.writes:
        raise SpecError(f"{which} of the product has no write term; each step is (I - a c^T) S + u z^T",
                        span)
    if not val.carried:
        raise SpecError("the update forgets S entirely; write the transition, e.g. S = exp(g) S + k v^T", span)
    return (*canonical(lw, val.carried, span, "left"), _write(lw, val, span))


def _write(lw, val: St, span) -> ir.Write:
    writes = _combine(list(val.writes), lw, span, "write")
    if not writes:
        raise SpecError("the update has no write term; add the rank-1 write, e.g. + k v^T", span)
    (key, value), = writes
    vsyms = [lw.symbols[n] for n, k in lw.kinds.items() if k == "V"]
    coeff, vpart = sp.Mul(value).as_independent(*vsyms, as_Add=False)
    return ir.Write(sp.factor_terms(key * coeff), vpart)


def canonical(lw, carried, span, side: str):
    """One side's transition as (Decay, Delta or None): M over key channels (side "left") or N over
    value channels (side "right")."""
    diag = sp.Integer(0)
    outers = []
    for t in carried:
        if t[0] == "diag":
            diag += t[1]
        else:
            outers.append((t[1], t[2]))
    outers = _combine(outers, lw, span, "transition")
    d = simplified(diag) if diag.has(sp.Abs) else sp.factor_terms(diag)
    if d == 0:
        raise SpecError("the transition has no diagonal part (no I, diag(...) or scalar times S); the "
                        "accepted forms are (I - a c^T) D S and D (I - a c^T) S", span)
    chan, other = ("V", "K") if side == "right" else ("K", "V")  # the channels N (or M) runs over
    for sym in d.free_symbols:
        if lw.kinds.get(str(sym)) == other:
            where = ("from the right, so it varies over value channels (V)" if side == "right" else
                     "from the left, so it varies over key channels (K)")
            raise SpecError(f"the decay multiplies S {where}, not over {'key' if other == 'K' else 'value'} "
                            f"channels; '{sym}' is a [{other}] value", span)
    kinds = {str(s): lw.kinds.get(str(s)) for s in d.free_symbols}
    if d == 1:
        decay = ir.Decay("identity", d)
    elif not d.free_symbols - {ir.HEAD}:
        decay = ir.Decay("constant", d)
    elif chan in kinds.values():
        decay = ir.Decay("diagonal", d)
    else:
        decay = ir.Decay("scalar", d)
    delta = None
    if outers:
        (u, e), = outers
        vec = [lw.symbols[n] for n, k in lw.kinds.items() if k in ("K", "V")]

        def per_head_in_a(dl):
            # per-head numbers commute: (I - k (beta k)^T) is (I - (beta k) k^T); keep them in a.
            # Done before the two orders are compared: a constant in front of the transition
            # divides c in the left order, and must not make the right one, with its D^-1, win
            coeff, rest = sp.Mul(dl.c).as_independent(*vec, as_Add=False)
            return ir.Delta(sp.factor_terms(dl.a * coeff), rest, dl.order) if coeff != 1 else dl

        left = per_head_in_a(ir.Delta(-u, sp.factor_terms(e / d), "left"))
        right = per_head_in_a(ir.Delta(sp.factor_terms(-u / d), e, "right"))
        # an order whose a or c divides by a data-dependent decay (exp(-g)) would compute D^-1,
        # which overflows where the decay underflows (g = -120: nan in every path) although M is
        # finite; where both orders would, M is kept as written, D - a c^T (order "sum", the
        # additive DPLR form of RWKV-7), which the kernels compute with in-chunk decays only
        inverse = lambda dl: any(_divides_by_decay(x, d, lw.kinds, chan) for x in (dl.a, dl.c))
        score = lambda dl: (inverse(dl), sp.count_ops(dl.a) + sp.count_ops(dl.c))
        delta = left if score(left) <= score(right) else right
        if decay.kind != "diagonal":  # a scalar D commutes: one canonical order
            delta = ir.Delta(delta.a, delta.c, "left")
        if inverse(delta):
            delta = per_head_in_a(ir.Delta(-u, e, "sum"))
    return decay, delta


def _divides_by_decay(x, d, kinds: dict, chan: str = "K") -> bool:
    """x divides by the data-dependent part of the decay d: a symbol of d's is in its denominator
    (exp(-g) counts as 1/exp(g)), or x d is free of d's symbols where x is not (x holds 1/d, as
    exp(exp(A) softplus(dt)) does for d = exp(-exp(A) softplus(dt)))."""
    data = {s for s in d.free_symbols if kinds.get(str(s)) in (chan, "scalar") and s != ir.HEAD}
    if not x.free_symbols & data:
        return False
    if sp.fraction(sp.together(x))[1].free_symbols & data:
        return True
    return not simplified(x * d).free_symbols & data


def _combine(pairs, lw, span, what):
    """Merge rank-1 terms u c^T that share a factor (up to a per-head number); refuse a rank-2 rest."""
    out = []
    for u, c in pairs:
        for i, (u2, c2) in enumerate(out):
            r = simplified(c / c2)
            if _per_head(r, lw):
                out[i] = (sp.factor_terms(u2 + u * r), c2)
                break
            r = simplified(u / u2)
            if _per_head(r, lw):
                out[i] = (u2, sp.factor_terms(c2 + c * r))
                break
        else:
            out.append((u, c))
    out = [(u, c) for u, c in out if simplified(u) != 0 and simplified(c) != 0]
    if len(out) > 1:
        form = " + ".join(f"({u}) ({c})^T" for u, c in out)
        raise SpecError(f"the {what} has {len(out)} independent rank-1 terms ({form}); lrdsl compiles one "
                        f"rank-1 erase (I - a c^T) D and one rank-1 write u z^T", span)
    return out


def _per_head(r, lw) -> bool:
    return all(lw.kinds.get(str(s)) in ("scalar", None) for s in r.free_symbols)
