"""Axis form (decay / gain / precond / solve / normalize lines) -> explicit-form statements.

The statements built here carry the span of the axis line they come from, so an error found later
(an unstable range, say) still points at the line the user wrote.

Inputs, params and lets may stand beside the axes to define the gates an axis names: `let g =
-exp(A_log) * softplus(a + dt_bias)` then `decay scalar g`. An axis declares an input only for a
name the spec does not define; a defined one keeps its definition (a let's range is proved).
"""
from __future__ import annotations

from fractions import Fraction

from lrdsl.errors import SpecError
from lrdsl.frontend.syntax import (
    Allow,
    AxisDecay,
    AxisGain,
    AxisNormalize,
    AxisPrecond,
    AxisSolve,
    BinOp,
    Call,
    Decl,
    Inputs,
    Let,
    Neg,
    Num,
    Params,
    Range,
    Readout,
    Spec,
    StateDecl,
    Transpose,
    Update,
    Var,
)

AXES = (AxisDecay, AxisGain, AxisPrecond, AxisSolve, AxisNormalize)
EXPLICIT = (StateDecl, Update, Readout)
GATES = (Inputs, Params, Let)  # may define what the axes name
ATK_DEFAULTS = {"x": Fraction(3, 2), "center": Fraction(-1, 5)}


def is_axis_form(spec: Spec) -> bool:
    return any(isinstance(s, AXES) for s in spec.statements)


def desugar(spec: Spec) -> Spec:
    """Return the explicit form of an axis-form spec (explicit specs pass through unchanged)."""
    if not is_axis_form(spec):
        return spec
    mixed = next((s for s in spec.statements if isinstance(s, EXPLICIT)), None)
    if mixed is not None:
        raise SpecError("this spec mixes the axis form (decay/gain/precond/solve lines) with an explicit "
                        "update (state, S = ..., o = ...); write it in one form (inputs, params and lets may "
                        "stand beside the axes to define their gates)", mixed.span)
    gates = tuple(s for s in spec.statements if isinstance(s, GATES))
    defined = {d.name for s in gates if not isinstance(s, Let) for d in s.decls}
    defined |= {s.name for s in gates if isinstance(s, Let)}
    axes = {}
    for s in spec.statements:
        if isinstance(s, (Allow, *GATES)):
            continue
        key = type(s).__name__
        if key in axes:
            raise SpecError(f"the {_axis_word(s)} axis is given twice; keep one line", s.span)
        axes[key] = s
    decay = axes.get("AxisDecay")
    gain = axes.get("AxisGain")
    precond = axes.get("AxisPrecond")
    solve = axes.get("AxisSolve")
    normalize = axes.get("AxisNormalize")
    offline = solve is not None and solve.kind == "offline"
    if solve is not None and (solve.lam is None) == offline:
        raise SpecError("`solve offline` names its regulariser, e.g. `solve offline lamb`; "
                        "`solve online` takes nothing after it", solve.span)
    if offline and gain is not None and gain.kind == "channelwise":
        raise SpecError("the offline solve (Mesa) goes with `gain none` or `gain scalar beta`: its "
                        "states accumulate u k^T and u v^T without an erase", solve.span)
    if offline and precond is not None and precond.kind != "none":
        raise SpecError("the offline solve (Mesa) takes no preconditioner: the solve is exact", solve.span)

    here = spec.span
    norm = set()
    if normalize is not None:
        for name, span in normalize.names:
            if name not in ("q", "k", "v"):
                raise SpecError(f"`normalize` applies to q, k or v, not '{name}'", span)
            norm.add(name)
    delta = gain is not None and gain.kind != "none"
    decls = [Decl("q", ("K", here), ("l2norm",) if "q" in norm else (), None, here),
             Decl("k", ("K", here), ("l2norm",) if "k" in norm else (("unit",) if delta else ()), None, here),
             Decl("v", ("V", here), ("l2norm",) if "v" in norm else (), None, here)]
    stmts = []

    def declare(decl, given_range=None):
        """Declare an input an axis names, unless the spec defines that name itself."""
        if decl.name not in defined:
            decls.append(decl)
        elif given_range is not None:
            raise SpecError(f"'{decl.name}' is defined in the spec, so its range comes from there (declared, "
                            "or proved for a let); drop the range from this line", given_range.span)

    # decay
    d_expr, d_kind = None, "none"
    if decay is not None:
        d_kind, span = decay.kind, decay.span
        if d_kind == "none":
            if decay.expr is not None:
                raise SpecError("`decay none` takes nothing after it", span)
        elif d_kind == "constant":
            if decay.expr is None:
                raise SpecError("`decay constant` needs an expression of the head index h, "
                                "e.g. `decay constant 1 - 2^(-5-h)`", span)
            d_expr = decay.expr
        else:
            if not isinstance(decay.expr, Var):
                raise SpecError(f"`decay {d_kind}` names its log-decay input, e.g. `decay {d_kind} g`", span)
            g = decay.expr
            declare(Decl(g.name, ("K", g.span) if d_kind == "diagonal" else None, ("log",), None, g.span))
            d_expr = Call("exp", (g,), (), span)

    # preconditioner
    site = None
    if precond is not None and precond.kind != "none":
        span = precond.span
        if precond.site is None:
            raise SpecError("`precond diagonal` needs a site and its inputs: atk(g_atk, beta_atk) or "
                            "atq(g_atk, beta_atk)", span)
        site = precond.site
        if len(precond.args) != 2 or not all(isinstance(a, Var) for a in precond.args):
            raise SpecError(f"{site}(...) takes two input names, its log-decay and its gain, "
                            f"e.g. {site}(g_atk, beta_atk, x = 1.5, center = -0.2)", span)
        opts = dict(ATK_DEFAULTS)
        for name, val in precond.kwargs:
            if name not in opts:
                raise SpecError(f"{site}(...) has no option '{name}'; its options are x and center", span)
            opts[name] = _const(val, f"{site} option {name}")
        ga, ba = precond.args
        declare(Decl(ga.name, None, ("log", "shared"), None, ga.span))
        declare(Decl(ba.name, None, ("shared",), Range(Fraction(0), Fraction(1), True, True, ba.span), ba.span))
        k = Var("k", span)
        stmts.append(StateDecl("p_atk", ("K", span), BinOp("add",
            BinOp("emul", Call("exp", (ga,), (), span), Var("p_atk", span), span),
            BinOp("emul", BinOp("emul", ba, k, span), k, span), span), span))
        stmts.append(Let("m_atk", Call("squash", (Var("p_atk", span),),
                                       tuple((n, Num(v, span)) for n, v in opts.items()), span), span))
    elif precond is not None and precond.site is not None:
        raise SpecError("`precond none` takes nothing after it", precond.span)

    # gain and the update
    span = gain.span if gain is not None else spec.span
    k, v, S, I = Var("k", span), Var("v", span), Var("S", span), Var("I", span)
    key = BinOp("emul", Var("m_atk", span), k, span) if site == "atk" else k
    erase, write = None, BinOp("matmul", key, Transpose(v, span), span)
    kind = gain.kind if gain is not None else "none"
    if kind == "none":
        if gain is not None and gain.inputs:
            raise SpecError("`gain none` takes no inputs", span)
    elif kind == "scalar":
        if len(gain.inputs) != 1:
            raise SpecError("`gain scalar` takes one input, e.g. `gain scalar beta in (0, 1)`", span)
        name, rng, nspan = gain.inputs[0]
        declare(Decl(name, None, (), rng or Range(Fraction(0), Fraction(1), True, True, nspan), nspan), rng)
        beta = Var(name, nspan)
        if not offline:  # the offline solve replaces the online erase
            erase = BinOp("matmul", BinOp("matmul", beta, key, span), Transpose(k, span), span)
        write = BinOp("matmul", BinOp("matmul", beta, key, span), Transpose(v, span), span)
    else:  # channelwise
        if len(gain.inputs) != 2:
            raise SpecError("`gain channelwise` takes an erase gate and a write gate, e.g. "
                            "`gain channelwise b, w`", span)
        (bn, br, bs), (wn, wr, ws) = gain.inputs
        declare(Decl(bn, ("K", bs), (), br or Range(Fraction(0), Fraction(1), False, False, bs), bs), br)
        declare(Decl(wn, ("V", ws), (), wr or Range(Fraction(0), Fraction(1), False, False, ws), ws), wr)
        erase = BinOp("matmul", key, Transpose(BinOp("emul", Var(bn, bs), k, span), span), span)
        write = BinOp("matmul", key, Transpose(BinOp("emul", Var(wn, ws), v, span), span), span)

    trans = BinOp("sub", I, erase, span) if erase is not None else None
    if d_kind == "diagonal":
        diag = Call("diag", (d_expr,), (), span)
        trans = diag if trans is None else BinOp("matmul", trans, diag, span)
    elif d_expr is not None:
        trans = d_expr if trans is None else BinOp("matmul", d_expr, trans, span)
    carried = S if trans is None else BinOp("matmul", trans, S, span)
    stmts.append(Update(BinOp("add", carried, write, span), span))
    q = Var("q", span)
    query = BinOp("emul", Var("m_atk", span), q, span) if site == "atq" else q
    read = Transpose(S, span)
    if offline:
        lam, lspan = solve.lam
        declare(Decl(lam, ("K", lspan), (), Range(Fraction(0), None, True, True, lspan), lspan))
        gram = BinOp("add", Var("G", solve.span), Call("diag", (Var(lam, lspan),), (), lspan), solve.span)
        read = BinOp("matmul", read, BinOp("pow", gram, Neg(Num(Fraction(1), solve.span), solve.span),
                                           solve.span), solve.span)
    # an error about the solve (ill-posed, ill-conditioned) points at the solve line
    stmts.append(Readout(BinOp("matmul", read, query, span), solve.span if offline else span))
    allows = tuple(s for s in spec.statements if isinstance(s, Allow))
    return Spec(spec.name, (Inputs(tuple(decls), spec.span), *gates, *stmts, *allows), spec.span)


def _const(node, what: str) -> Fraction:
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Neg) and isinstance(node.x, Num):
        return -node.x.value
    raise SpecError(f"{what} must be a number", getattr(node, "span", None))


def _axis_word(s) -> str:
    return type(s).__name__[4:].lower()


MAX_CG_STEPS = 1000


def solve_steps(spec: Spec) -> tuple:
    """(spec, steps, span): the conjugate-gradient step count of the offline solve, from
    `solve offline lamb steps N` (axis form) or the line `solve offline steps N` beside explicit
    statements (then taken out of the spec, which stays explicit); steps is None when not given."""
    lines = [s for s in spec.statements if isinstance(s, AxisSolve) and s.steps is not None]
    if not lines:
        return spec, None, None
    line = lines[0]
    text, span = line.steps
    if not text.isdigit() or not 1 <= int(text) <= MAX_CG_STEPS:
        raise SpecError(f"the number of conjugate-gradient steps must be a whole number from 1 to "
                        f"{MAX_CG_STEPS}, e.g. `steps 30`", span)
    if line.kind != "offline":
        raise SpecError("`steps` counts the conjugate-gradient steps of the offline solve: write "
                        "`solve offline lamb steps 30`", span)
    option_only = line.lam is None and not any(isinstance(s, AXES) and s is not line for s in spec.statements)
    if option_only and any(isinstance(s, EXPLICIT) for s in spec.statements):
        spec = Spec(spec.name, tuple(s for s in spec.statements if s is not line), spec.span)
    return spec, int(text), span
