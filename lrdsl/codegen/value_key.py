"""A value-side transition run on the key side's staged kernels (issue 40).

S = S N + u z^T with N [V, V] is, on T = S^T [V, K], T_t = N_t^T T_{t-1} + z_t u_t^T. For
N = D (I - a c^T) that is T_t = (I - c a^T) D T_{t-1} + z u^T: a key-side transition of the KDA
class on keys of width V and values of width K, which the staged kernels run chunk-parallel on
tensor cores. Only the readout differs (o_t = T_t q_t contracts T's second axis), so the staged
kernels make the chunk-start states and the pseudo-values and a kernel of its own reads o
(templates/chunk_value_out.py.jinja, runtime/value_key.py).

Which transitions: N = D (I - a c^T) with D a decay per value channel, per head, constant or none,
and S's write value the erase's c (on T the write key is then the erase's direction, as the staged
kernels' readout of T_t from the pseudo-values needs). With one number per head D commutes with the
erase, so (I - a c^T) D is the same. With D per channel that other order is D (I - c a^T) on T: a
decay after the erase, which the key side runs on its split spec (two sub-tokens per token): not
here yet. D - a c^T (additive) and M S N keep the token loop kernel (templates/chunk_value.py.jinja)."""
from __future__ import annotations

import dataclasses
import os

import sympy as sp

from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified

# the sub-mixer's inputs: query (unread by the stages it runs: any [V] tensor), N's c (on T the
# erase's write direction and the write's key: eligible asks that S's write value be c), N's a (on T
# the erase's read direction), the write's value (S's write key, width K), the log-decay
Q, C, A, U, G = "q", "k", "w", "v", "g"

SWITCH = "LRDSL_VALUE_STAGED"  # "0": every value side keeps the token loop forward


def eligible(m: ir.Mixer) -> str | None:
    """Why m's chunked forward keeps the token loop kernel, or None where it takes the staged one."""
    if m.side != "right":
        return "not a value-side transition"
    if m.delta is None:
        return "no erase (the token loop has no solve to spare)"
    if m.delta.order == "sum":
        return "N = D - a c^T (additive): not of the form the staged kernels take"
    if m.delta.order == "left" and m.decay.kind == "diagonal":
        return ("the erase is before the decay, N = (I - a c^T) D: on S^T a decay after the erase, which "
                "the key side runs only on its split spec")
    if simplified(m.write.value - m.delta.c) != 0:
        return "the write's value is not the erase's read direction c (on S^T, a write key of its own)"
    return None


def enabled(m: ir.Mixer) -> bool:
    """The chunked forward of m takes the staged kernels (and LRDSL_VALUE_STAGED is not 0)."""
    return os.environ.get(SWITCH, "1") != "0" and eligible(m) is None


def sub_ir(m: ir.Mixer) -> ir.Mixer:
    """The key-side mixer whose state is m's transposed: T = (I - c a^T) D T + c u^T, its inputs the
    per-token vectors (runtime/value_key.py computes them), plain and unclamped; the log-decay
    declared <= 0 (the kernels floor it as everywhere)."""
    def vec(name, kind):
        return ir.Input(name, kind, False, l2norm=False, unit=False, log=False, lo=-sp.oo, hi=sp.oo,
                        lo_open=True, hi_open=True)
    inputs = [vec(Q, "K"), vec(C, "K"), vec(A, "K"), vec(U, "V")]
    decay = ir.Decay("identity", sp.Integer(1))
    if m.decay.kind != "identity":
        g_in = vec(G, "K" if m.decay.kind == "diagonal" else "scalar")  # a constant: a number per token
        inputs.append(dataclasses.replace(g_in, log=True, hi=sp.Integer(0), hi_open=False))
        decay = ir.Decay("diagonal" if m.decay.kind == "diagonal" else "scalar", sp.exp(ir.symbol(G)))
    # N^T = (I - c a^T) D: on T the erase writes along c and reads along a
    delta = ir.Delta(ir.symbol(C), ir.symbol(A), "left")
    write = ir.Write(ir.symbol(C), ir.symbol(U))
    return ir.Mixer(f"{m.name}_transposed", tuple(inputs), (), (), decay, delta, write, ir.symbol(Q),
                    allow_unstable=True)
