"""A readout with terms beside S^T x, as mixers whose kernels read S^T x alone.

    o_t = S_t^T x_t + S_{t-1}^T y_t + sum_i (p_i^T r_i) z_i        (times scale)

The kernels read the state after each token's update. S_{t-1}^T y_t is the readout of the state
after token t-1 with the query y of token t: the same kernels, run with y's inputs moved one token
earlier (each input that y reads gets a copy named <input>_next, holding the next token's value),
give it at token t-1, and lrdsl.Mixer moves those outputs one token later; the first token of each
sequence reads the initial state (runtime/readouts.py). The dot-product terms need no state: they
are elementwise work on the inputs, done in PyTorch beside the kernels. RWKV-6's readout
o = S_prev^T r + (r^T (u*k)) v is of this form."""
from __future__ import annotations

import dataclasses

import sympy as sp

from lrdsl.frontend import ir


def core_ir(m: ir.Mixer) -> ir.Mixer | None:
    """m reading S^T x alone (None where its readout has no S^T x term)."""
    if m.query == 0:
        return None
    return dataclasses.replace(m, query_prev=sp.Integer(0), bonus=())


def prev_ir(m: ir.Mixer) -> tuple:
    """(the mixer whose S^T x, at token t-1, is m's S_prev^T y at token t; {shifted input: input})
    or (None, {}) where m's readout has no S_prev term."""
    if m.query_prev == 0:
        return None, {}
    y = m.inline_lets(m.query_prev)
    taken = set(m.kinds())
    shifted, subs, inputs = {}, {}, list(m.inputs)
    for i in m.inputs:
        if i.symbol in y.free_symbols:
            name = _free(f"{i.name}_next", taken)
            taken.add(name)
            shifted[name] = i.name
            inputs.append(dataclasses.replace(i, name=name, span=None))
            subs[i.symbol] = ir.symbol(name)
    out = dataclasses.replace(m, name=f"{m.name}_prev", inputs=tuple(inputs), query=y.xreplace(subs),
                              query_prev=sp.Integer(0), bonus=())
    return out, shifted


def _free(name: str, taken: set) -> str:
    base, i = name, 1
    while name in taken:
        name, i = f"{base}{i}", i + 1
    return name
