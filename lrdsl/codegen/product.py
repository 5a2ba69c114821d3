"""A product of n steps per token, as n sub-tokens of a one-step mixer.

DeltaProduct's token update (n steps, the decay on the first),

    S <- (I - a_1 c_1^T) D S + u_1 z_1^T,   then   S <- (I - a_j c_j^T) S + u_j z_j^T   (j = 2..n),

is the one-step update S <- (I - a c^T) exp(g) S + u z^T run on n sub-tokens per token, with
g = log D at the first sub-token and 0 at the others, and (a, c, u, z) those of step j at sub-token j.
The readout of a token is the sub-mixer's at its last sub-token (o = S^T q after all n steps), and
its kernels are generated like any spec's: chunk forward and backward, recurrent, step, context
parallelism and the layer follow.

Two sub-mixers. In general its inputs are the per-step vectors (a, c, u, z) themselves, computed in
PyTorch from the spec's inputs in float32 (runtime/product.py interleaves them). Where every step is
a delta-rule step on plain inputs, (I - b_j k_j k_j^T) S + b_j k_j v_j^T with b_j a per-token
number and k_j, v_j inputs of the spec (`direct`), the sub-mixer is the gated delta rule itself: the
spec's own k_j and v_j are interleaved as they come (normalised inside the kernels where the spec
says l2norm) and only the numbers b_j and the log-decay are computed in PyTorch. That glue moves
n (3 + ...) [B, T, H, K] tensors in the input dtype instead of about 4n in float32 (2026-12-06: the
general glue took 3.0 of delta_product2's 4.0 ms forward at B=4 T=4096 H=16 on an H100)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy as sp

from lrdsl.checks.ranges import Ranges
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified

# the sub-mixer's inputs: query, erase read direction, write value, erase direction, write key, log-decay,
# and the direct form's gain
Q, C, Z, A, U, G, BETA = "q", "k", "v", "w", "u", "g", "beta"


@dataclass(frozen=True)
class Direct:
    """A product of delta-rule steps on plain inputs: the query's input name, each step's key and
    value input names and gain (a sympy expression of scalar inputs, params and h)."""
    query: str
    keys: tuple
    values: tuple
    gains: tuple


def steps_of(m: ir.Mixer) -> tuple:
    """(a, c, u, z) of each of m's steps, in order. A step without erase reads c = 0 along a = u:
    (I - u 0^T) is I, and the erase direction stays the write key, as the staged kernels want it."""
    out = []
    for delta, write in ((m.delta, m.write), *((st.delta, st.write) for st in m.steps)):
        a, c = (delta.a, delta.c) if delta is not None else (write.key, sp.Integer(0))
        out.append((a, c, write.key, write.value))
    return tuple(out)


def separate_key(m: ir.Mixer) -> bool:
    """Some step's erase direction is not its write key: the sub-mixer then reads both."""
    return any(simplified(a - u) != 0 for a, _, u, _ in steps_of(m))


def direct(m: ir.Mixer) -> Direct | None:
    """m's steps as delta-rule steps on plain inputs, or None. Each step must be
    (I - b k k^T) S + b k v^T with k a [K] input and v a [V] input of the spec, neither clamped, all
    keys alike (normalised or not) and all values alike, b free of vectors and lets;
    the query a plain unclamped [K] input."""
    inputs = {i.name: i for i in m.inputs}
    scalars = {i.name for i in (*m.inputs, *m.params) if i.kind == "scalar"} | {"h"}

    def plain(e, kind):
        i = inputs.get(e.name) if isinstance(e, sp.Symbol) else None
        return i if i is not None and i.kind == kind and not i.clamped else None

    query = plain(m.query, "K")
    keys, values, gains = [], [], []
    for a, c, u, z in steps_of(m):
        k, v = plain(c, "K"), plain(z, "V")
        if query is None or k is None or v is None or simplified(a - u) != 0:
            return None
        b = simplified(a / c)
        if {s.name for s in b.free_symbols} - scalars:
            return None
        keys.append(k)
        values.append(v)
        gains.append(b)
    lets = {lt.name for lt in m.lets}
    if m.decay.kind != "identity" and {s.name for s in m.log_decay().free_symbols} & lets:
        return None
    same = lambda xs: len({dataclasses.replace(x, name="", span=None, shared=False) for x in xs}) == 1
    if not (same(keys) and same(values)):
        return None
    return Direct(query.name, tuple(k.name for k in keys), tuple(v.name for v in values), tuple(gains))


def sub_ir(m: ir.Mixer) -> ir.Mixer:
    """The one-step mixer whose n sub-tokens per token are m's n steps."""
    def vec(name, kind, shared=False):
        return ir.Input(name, kind, shared, l2norm=False, unit=False, log=False, lo=-sp.oo, hi=sp.oo,
                        lo_open=True, hi_open=True)
    d = direct(m)
    if d is not None:
        named = {i.name: i for i in m.inputs}
        # a key or value shared by the value heads of its key head where another is not: the
        # sub-mixer reads them all per value head (runtime/product.py repeats the shared ones)
        shared = lambda names: all(named[x].shared for x in names)
        inputs = [dataclasses.replace(named[d.query], name=Q, span=None),
                  dataclasses.replace(named[d.keys[0]], name=C, span=None, shared=shared(d.keys)),
                  dataclasses.replace(named[d.values[0]], name=Z, span=None, shared=shared(d.values)),
                  vec(BETA, "scalar")]
        both = False
    else:
        inputs = [vec(Q, "K", True), vec(C, "K", True), vec(Z, "V"), vec(A, "K")]
        both = separate_key(m)
        if both:
            inputs.append(vec(U, "K"))
    decay = ir.Decay("identity", sp.Integer(1))
    if m.decay.kind != "identity":
        g_in = vec(G, "K" if m.decay.kind == "diagonal" else "scalar")
        if Ranges(m).of(m.inline_lets(m.log_decay()))[1] <= 0:
            # a log-decay, as the kernels know one: a reset (-inf) gets a zero gradient there, where
            # an input of no declared range gives nan gradients (measured 2026-12-06)
            g_in = dataclasses.replace(g_in, log=True, hi=sp.Integer(0), hi_open=False)
        inputs.append(g_in)
        g = ir.symbol(G)
        decay = ir.Decay("diagonal" if m.decay.kind == "diagonal" else "scalar", sp.exp(g))
    has_erase = m.delta is not None or any(st.delta is not None for st in m.steps)
    order = m.delta.order if m.delta is not None else "left"
    a = ir.symbol(BETA) * ir.symbol(C) if d is not None else ir.symbol(A)
    delta = ir.Delta(a, ir.symbol(C), order) if has_erase else None
    write = ir.Write(ir.symbol(U) if both else a, ir.symbol(Z))
    return ir.Mixer(f"{m.name}_steps", tuple(inputs), (), (), decay, delta, write, ir.symbol(Q),
                    allow_unstable=True, sub_tokens=m.n_steps if d is not None else 0)


def with_sub_tokens(m: ir.Mixer, p):
    """Plan p with plan.sub_tokens and the inputs it reads by sub-token (those of codegen/product.py's
    direct sub-mixer) where its staged kernels are those that have the holes: an erase, a decay per
    token, stage 3 split (staged_de stores dz, staged_dk's chain rule the others) and the query's
    gradient made where r's is (plan.chain_at_dr). Elsewhere the runtime gives interleaved tensors."""
    if not (m.sub_tokens and p.staged and p.delta and p.decay_kind == "scalar" and p.split_dk and p.split_dr
            and p.chain_in_dk and p.chain_at_dr is not None and p.chain_at_dr.name == Q):
        return p
    return dataclasses.replace(p, sub_tokens=m.sub_tokens, sub_steps=(C, Z), sub_query=Q)
