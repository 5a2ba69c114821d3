"""The value side's token loop (templates/recurrent_value.py.jinja): the lines that apply M (over key
channels, only for M S N) and N (over value channels, from the right) to the state b_h, chosen here
so that the template stays straight-line. Each function returns the lines without indentation. And
whether the chunked forward (templates/chunk_value.py.jinja) may split the key channels."""
from __future__ import annotations

from dataclasses import dataclass

from lrdsl.codegen.plan import Plan


@dataclass(frozen=True)
class Side:
    """One factor's decay and erase: kind of decay, its expression, the erase's order ("" for none)
    and its vectors a, c."""
    kind: str
    decay: str
    order: str
    a: str
    c: str


def _n(plan: Plan) -> Side:
    if plan.side == "both":
        return Side(plan.n_decay_kind, plan.n_decay, plan.n_order, plan.n_erase_a, plan.n_erase_c)
    return Side(plan.decay_kind, plan.decay, plan.order if plan.delta else "", plan.erase_a, plan.erase_c)


def _m_lines(plan: Plan) -> list:
    """M S (for M S N, before N: it is (M S) N), the erase over key channels."""
    kind, lines = plan.decay_kind, []
    if kind == "diagonal":
        lines.append(f"m_d = tl.where(m_k, {plan.decay}, 0.0)")
    elif kind != "identity":
        lines.append(f"m_d = {plan.decay}")
    dv = "m_d[:, None]" if kind == "diagonal" else "m_d"
    decay = [] if kind == "identity" else [f"b_h = b_h * {dv}"]
    if not plan.delta:
        return lines + decay
    lines += [f"m_a = tl.where(m_k, {plan.erase_a}, 0.0)", f"m_c = tl.where(m_k, {plan.erase_c}, 0.0)"]
    read = "m_a[:, None] * tl.sum(b_h * m_c[:, None], 0)[None, :]"
    if plan.order == "sum":
        return lines + [f"b_h = b_h{'' if kind == 'identity' else ' * ' + dv} - {read}"]
    return lines + (decay + [f"b_h -= {read}"] if plan.order == "left" else [f"b_h -= {read}"] + decay)


def loads(plan: Plan) -> tuple:
    """M applied (M S N) and N's decay and erase vectors loaded."""
    n = _n(plan)
    lines = _m_lines(plan) if plan.side == "both" else []
    if n.kind == "diagonal":
        lines.append(f"d_t = tl.where(m_v, {n.decay}, 0.0)")
    elif n.kind != "identity":
        lines.append(f"d_t = {n.decay}")
    if n.order:
        lines += [f"e_a = tl.where(m_v, {n.a}, 0.0)", f"e_c = tl.where(m_v, {n.c}, 0.0)"]
    return tuple(lines)


def apply(plan: Plan) -> tuple:
    """N applied to the state's rows from the right."""
    n = _n(plan)
    dv = "d_t[None, :]" if n.kind == "diagonal" else "d_t"
    decay = [] if n.kind == "identity" else [f"b_h = b_h * {dv}"]
    read = "tl.sum(b_h * e_a[None, :], 1)[:, None] * e_c[None, :]"
    if n.order == "left":
        return ("# S (I - a c^T) D: the erase reads the rows before the decay", f"b_h -= {read}", *decay)
    if n.order == "sum":
        return ("# S (D - a c^T)", f"b_h = b_h{'' if n.kind == 'identity' else ' * ' + dv} - {read}")
    if n.order:
        return ("# S D (I - a c^T): the erase reads the decayed rows", *decay, f"b_h -= {read}")
    return tuple(decay)


def k_split(plan: Plan) -> bool:
    """Whether the chunked forward's programs may take a tile of the key channels each: no input
    over K is L2-normalised and no expression reduces over an axis (a tile would see part of K)."""
    if any(ld.kind == "K" and ld.l2norm for ld in plan.loads):
        return False
    texts = [s.expr for s in plan.lets] + [plan.log_decay, plan.erase_a, plan.erase_c, plan.write_key,
                                           plan.write_value, plan.query]
    return not any(f"tl.{r}(" in t for t in texts for r in ("sum", "max", "min", "reduce", "cumsum"))
