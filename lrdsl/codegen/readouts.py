"""A readout with terms beside S^T x, as mixers whose kernels read S^T x alone.

    o_t = S_t^T x_t + S_{t-1}^T y_t + sum_i (p_i^T r_i) z_i        (times scale)

The kernels read the state after each token's update. S_{t-1}^T y_t is the readout of the state
after token t-1 with the query y of token t: the same kernels, run with y's inputs moved one token
earlier (each input that y reads gets a copy named <input>_next, holding the next token's value),
give it at token t-1, and lrdsl.Mixer moves those outputs one token later; the first token of each
sequence reads the initial state (runtime/readouts.py). The dot-product terms need no state: they
are elementwise work on the inputs, done in PyTorch beside the kernels. RWKV-6's readout
o = S_prev^T r + (r^T (u*k)) v is of this form.

Where the readout is S_prev^T y alone, or with one bonus (y^T b) z whose z is the written value,
and the transition takes the staged kernels with a decay per key channel and no erase, the staged
kernels read it themselves in one chunk pass instead (fused; plan.readout_before): the state before
token t is the prefix of t-1 tokens, so within a chunk y_t meets the keys s < t only, decayed by
G_{t-1} - G_s (the query's own decay excluded), and the bonus is the score matrix's diagonal
y_t . b_t, b carried as the per-token vector c (no erase uses it there)."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import sympy as sp

from lrdsl.codegen.split import not_staged
from lrdsl.frontend import ir
from lrdsl.frontend.symbolic import simplified


@dataclass(frozen=True)
class Fused:
    """A readout the staged kernels read in one chunk pass (fused)."""
    query: sp.Expr  # y of S_prev^T y
    bonus_key: sp.Expr | None  # b of the bonus (y^T b) z (None without one)


@functools.lru_cache(maxsize=256)  # the backward's PyTorch chain rule asks at every call
def fused(m: ir.Mixer) -> Fused | None:
    """The fused readout of m, or None where m keeps the parts' kernels (core_ir, prev_ir)."""
    if (m.query != 0 or m.query_prev == 0 or len(m.bonus) > 1 or m.delta is not None or m.aux
            or m.solve_lam is not None or m.decay.kind != "diagonal" or not_staged(m)):
        return None
    y = m.inline_lets(m.query_prev)
    if not m.bonus:
        return Fused(y, None)
    bn = m.bonus[0]
    if bn.kind != "K" or simplified(m.inline_lets(bn.value) - m.inline_lets(m.write.value)) != 0:
        return None
    b = sp.cancel(m.inline_lets(bn.summand) / y)
    if sp.fraction(b)[1].free_symbols or simplified(b * y - m.inline_lets(bn.summand)) != 0:
        return None  # the summand is not y times a vector of its own
    return Fused(y, b)


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
