"""A product of n steps per token, as n sub-tokens of a one-step mixer.

DeltaProduct's token update (n steps, the decay on the first),

    S <- (I - a_1 c_1^T) D S + u_1 z_1^T,   then   S <- (I - a_j c_j^T) S + u_j z_j^T   (j = 2..n),

is the one-step update S <- (I - a c^T) exp(g) S + u z^T run on n sub-tokens per token, with
g = log D at the first sub-token and 0 at the others, and (a, c, u, z) those of step j at sub-token j.
The readout of a token is the sub-mixer's at its last sub-token (o = S^T q after all n steps). So
the sub-mixer's inputs are the per-step vectors themselves, computed in PyTorch from the spec's
inputs (runtime/product.py interleaves them), and its kernels are generated like any spec's: chunk
forward and backward, recurrent, step, context parallelism and the layer follow."""
from __future__ import annotations

import dataclasses

import sympy as sp

from lrdsl.checks.ranges import Ranges
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified

# the sub-mixer's inputs: query, erase read direction, write value, erase direction, write key, log-decay
Q, C, Z, A, U, G = "q", "k", "v", "w", "u", "g"


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


def sub_ir(m: ir.Mixer) -> ir.Mixer:
    """The one-step mixer whose n sub-tokens per token are m's n steps."""
    def vec(name, kind, shared=False):
        return ir.Input(name, kind, shared, l2norm=False, unit=False, log=False, lo=-sp.oo, hi=sp.oo,
                        lo_open=True, hi_open=True)
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
    a = ir.symbol(A)
    delta = ir.Delta(a, ir.symbol(C), order) if has_erase else None
    write = ir.Write(ir.symbol(U) if both else a, ir.symbol(Z))
    return ir.Mixer(f"{m.name}_steps", tuple(inputs), (), (), decay, delta, write, ir.symbol(Q),
                    allow_unstable=True)
