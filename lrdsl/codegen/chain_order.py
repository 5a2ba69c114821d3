"""The order of the statements of staged_dk's chain-rule epilogue (_chain_tokens, plan.chain_in_dk).

The epilogue reads [BT, BK] fp32 tiles (the vector gradients c's and r's, each key-channel input),
64 registers per thread each at BT = BK = 64 and 4 warps. A load cannot move below a store to
another pointer (the two may alias), so with every tile loaded at the top all were live together,
through every gradient's store: comba's staged_dk spilled 488/556 (st/ld), gated_deltanet's 52/52
(docs/kernels.md, 2026-12-06). Here each load is emitted right before the first statement that
reads it, and the gradients (a key-channel input's, then its store) and per-token sums (s_<name>)
come in the order that keeps the fewest tiles live: a greedy choice, each time the one whose
peak (tiles live while it runs) and then aftermath (tiles still live after it) are least; ties go
to the sums (what they leave is one number per token) and then to the inputs' order. Only the
order changes: the same statements, the same loads and masks.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"\b[A-Za-z_]\w*\b")


@dataclass(frozen=True)
class Stmt:
    """One statement (or a few that belong together) of the epilogue."""
    macro: str  # the chain_rule_macros.jinja macro that renders it
    arg: object  # its argument: a vector's name, a Load, a (name, text) temporary, or None
    defines: tuple = ()  # the block variables it makes (b_dgl: its floored value)
    reads: frozenset = frozenset()  # the block variables it reads
    tile: bool = False  # its first variable is a [BT, BK] tile (else [BT, 1] numbers, or nothing)
    consumer: bool = False  # a gradient's store or a per-token sum: what the epilogue is for


def _reads(*texts: str) -> frozenset:
    return frozenset(n for t in texts for n in _NAME.findall(t))


def statements(plan) -> tuple:
    """_chain_tokens' statements in the order the template emitted them before 2026-12-06: the
    head index, the loads of the vector gradients it reads from memory (plan.chain_stored), the
    inputs' loads (but those whose gradient is made where a vector's is: plan.chain_ats), the
    log-decay's floor, the shared subexpressions, the key-channel gradients and per-token sums in
    the inputs' order, then the sums' stores."""
    ch = plan.chain
    taken = [l for _, l, _ in plan.chain_ats]
    out = [Stmt("head", None, ("h_f",))] if plan.uses_head else []
    for n in plan.chain_stored:
        if n != "c" or plan.delta or plan.bonus_key:  # c's gradient exists (else no reader)
            out.append(Stmt("vector_load", "d" + n, ("b_d" + n,), tile=True))
    loads = [(l, g) for l, g in zip(plan.loads, ch.grads) if l.kind in ("scalar", "K") and l not in taken]
    for l, _ in loads:
        out.append(Stmt("input_load", l, (l.var, "n_" + l.name) if l.l2norm else (l.var,), tile=l.kind == "K"))
    if ch.log_decay:
        out.append(Stmt("floor", None, ("b_dgl",), _reads(ch.log_decay)))
    tiles = {s.defines[0] for s in out if s.tile} | {"b_du"}
    for name, text in ch.k_temps:
        reads = _reads(text)
        out.append(Stmt("temp", (name, text), (name,), reads, tile=bool(reads & tiles)))
        tiles |= {name} if reads & tiles else set()
    for l, g in loads:
        reads = _reads(*(f"b_d{v} * {t}" for v, t in g.k_terms), f"b_dgl * {g.g_term}" if g.g_term else "")
        if l.kind == "K" and l.l2norm:
            reads |= {l.var, "n_" + l.name}
        out.append(Stmt("key_grad", l, () if l.kind == "K" else ("s_" + l.name,), reads, consumer=True))
    for l, _ in loads:
        if l.kind == "scalar":
            out.append(Stmt("scalar_store", l, (), frozenset({"s_" + l.name}), consumer=True))
    return tuple(out)


def order(stmts: tuple) -> tuple:
    """stmts (statements()'s) in the order that keeps the fewest tiles live (the module's doc)."""
    maker = {d: s for s in stmts for d in s.defines}  # b_du and b_dgl come in as arguments
    tiles = {s.defines[0] for s in stmts if s.tile} | {"b_du"}
    done = set()

    def needs(s, acc):  # the producers s waits for, not yet emitted (in stmts' order)
        for n in s.reads:
            p = maker.get(n)
            if p is not None and p not in done and p not in acc and not p.consumer:
                acc.add(p)
                needs(p, acc)
        return acc

    def ready(s):
        return all(maker[n] in done for n in s.reads if n in maker and maker[n].consumer)

    def live(emitted):  # tiles made and still read by a statement not emitted
        rest = [s for s in stmts if s not in emitted]
        return {t for t in tiles if (t == "b_du" or maker[t] in emitted) and any(t in s.reads for s in rest)}

    def cost(i, s):
        new = needs(s, set())
        after = done | new | {s}
        made = {d for p in new for d in p.defines if d in tiles}
        peak = len(live(done) | made) + bool(s.reads & tiles)  # + its own product tile
        return peak, len(live(after)), s.macro != "key_grad" or s.arg.kind != "scalar", i

    consumers = [s for s in stmts if s.consumer]
    # producers no consumer reads (dead: the compiler drops them) stay at the top, as before, with
    # what they read
    needed = set().union(*(needs(c, set()) for c in consumers))
    top = set().union(*(needs(p, {p}) for p in stmts if not p.consumer and p not in needed))
    out = [p for p in stmts if p in top]
    done |= top
    while consumers:
        i, s = min(((i, s) for i, s in enumerate(consumers) if ready(s)), key=lambda c: cost(*c))
        new = needs(s, set())
        out += [p for p in stmts if p in new] + [s]
        done |= new | {s}
        consumers.remove(s)
    return tuple(out)
