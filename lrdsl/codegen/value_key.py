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
here yet. D - a c^T (additive) and M S N keep the token loop kernel (templates/chunk_value.py.jinja).

Two sub-mixers (as codegen/product.py has). In general its inputs are the per-token vectors of T's
transition, computed in PyTorch (runtime/value_key.py's sub_inputs). Where N = D (I - b c c^T) with
c an l2norm'd [V] input, b a number input, D = diag(exp(g)) with g a log-declared [V] input and the
write b k c^T with k a plain [K] input (oja; `direct`), T's transition is
(I - b c c^T) D T + b c k^T: KDA on the raw inputs (keys c, values k, gain b, log-decay g), whose
kernels normalise c, clamp b into its declared range and floor g as the spec's other paths do, and
whose generated backward carries every gradient to the raw inputs: no per-token vectors in PyTorch
(2026-12-06: that glue took 5.9 of oja's 15.9 ms forward + backward at B=4 T=4096 H=16 K=V=128 on
an H100)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import sympy as sp

from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified

# the sub-mixer's inputs: query (unread by the stages it runs: any [V] tensor), N's c (on T the
# erase's write direction and the write's key: eligible asks that S's write value be c), N's a (on T
# the erase's read direction), the write's value (S's write key, width K), the log-decay
Q, C, A, U, G = "q", "k", "w", "v", "g"
GAIN = "beta"  # the direct form's gain (`direct`)

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


@dataclass(frozen=True)
class Direct:
    """The spec's input names that the direct sub-mixer reads: the query, the erase direction c (the
    sub's keys), the write key k (the sub's values), the gain b and the log-decay g."""
    query: str
    c: str
    k: str
    gain: str
    log: str


def direct(m: ir.Mixer) -> Direct | None:
    """m's transition as N = diag(exp(g)) (I - b c c^T), S's write b k c^T, on plain inputs (module
    docstring), or None (the per-token vectors then). Every input of m is one of those five; no
    lets, params or other readout terms; the decay per value channel, g declared `log` alone (the
    readout floors it into [floor, 0] as the kernels do)."""
    if eligible(m) is not None or m.delta.order != "right" or m.decay.kind != "diagonal":
        return None
    if m.lets or m.params or m.aux or m.bonus or m.steps or m.solve_lam is not None or m.query_prev != 0:
        return None
    inputs = {i.name: i for i in m.inputs}

    def name(e, kind, ok=lambda i: True):
        i = inputs.get(e.name) if isinstance(e, sp.Symbol) else None
        return i.name if i is not None and i.kind == kind and ok(i) else None

    plain = lambda i: not (i.l2norm or i.unit or i.log or i.clamped)
    c = name(m.delta.c, "V", lambda i: i.l2norm)
    gain = simplified(m.delta.a / m.delta.c) if c is not None else None
    b = name(gain, "scalar", lambda i: not i.log) if gain is not None else None
    k = name(simplified(m.write.key / gain), "K", plain) if b is not None else None
    q = name(m.query, "K", plain)
    g = name(m.log_decay(), "V", lambda i: i.log and i.lo == -sp.oo and i.hi == 0)
    d = Direct(q, c, k, b, g)
    if None in (q, c, k, b, g) or set(inputs) != {q, c, k, b, g} or len({q, c, k, b, g}) != 5:
        return None
    return d


def enabled(m: ir.Mixer) -> bool:
    """The chunked forward of m takes the staged kernels (and LRDSL_VALUE_STAGED is not 0)."""
    return os.environ.get(SWITCH, "1") != "0" and eligible(m) is None


def sub_ir(m: ir.Mixer) -> ir.Mixer:
    """The key-side mixer whose state is m's transposed: T = (I - c a^T) D T + c u^T, its inputs the
    per-token vectors (runtime/value_key.py computes them), plain and unclamped; the log-decay
    declared <= 0 (the kernels floor it as everywhere). Where `direct` takes m: KDA on m's raw inputs,
    each declared as in m (so normalised, clamped and floored as m's paths do), none shared
    (runtime/value_key.py repeats m's shared ones over the value heads)."""
    d = direct(m)
    if d is not None:
        named = {i.name: i for i in m.inputs}
        own = lambda src, dst, kind: dataclasses.replace(named[src], name=dst, kind=kind, shared=False, span=None)
        inputs = (own(d.c, Q, "K"), own(d.c, C, "K"), own(d.k, U, "V"), own(d.log, G, "K"),
                  own(d.gain, GAIN, "scalar"))
        inputs = (dataclasses.replace(inputs[0], l2norm=False, unit=False, lo=-sp.oo, hi=sp.oo, lo_open=True,
                                      hi_open=True), *inputs[1:])
        bk = ir.symbol(GAIN) * ir.symbol(C)
        return ir.Mixer(f"{m.name}_transposed", inputs, (), (), ir.Decay("diagonal", sp.exp(ir.symbol(G))),
                        ir.Delta(bk, ir.symbol(C), "left"), ir.Write(bk, ir.symbol(U)), ir.symbol(Q),
                        allow_unstable=True)
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
