"""The chain rule from the staged kernels' per-token vectors to the spec's inputs, derived here.

The staged backward ends with the gradients of the per-token vectors: the write key u (also the
erase direction), the erase read c, the scaled query r, the write value z and the log-decay gl.
Each is an elementwise expression of the inputs (lets substituted), so the gradient of an input is
a sum of (vector gradient) x (partial derivative), summed over the channels where the input has
fewer of them (a per-head input in a key-channel vector), then through the in-mixer L2 norm and
the range clamp. A param's line is the same: its per-token terms, summed over the tokens by the
host. sympy differentiates; `cse` shares the common subexpressions; texpr lowers them.
The offline solve's backward (codegen/solve.py) ends in the same kernel, with two more key-channel
vectors: the Gram state's other side kk (the key k) and the regulariser lam.
An auxiliary state P (a key-channel scan P_t = a_t P_{t-1} + w_t) is one more per-token operand
here: the kernel reads P and stores P's local gradient (the vectors' derivatives in P); the host
scans that back over the tokens (lrdsl/scan.py) into the gradient of the write w, one more
key-channel vector (aw_P) of a second launch of the same kernel (autograd.aux_chain_rule), which
makes the decay's (ad_P = aw_P times the state before the token) itself. Value-channel states, states read by other states' scans or by the
write value or a scalar decay keep the PyTorch chain rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import sympy as sp

from lrdsl.codegen.readouts import fused
from lrdsl.codegen.texpr import code, number, var
from lrdsl.frontend import ir
from lrdsl.frontend.primitives import inlined


@dataclass(frozen=True)
class InputGrad:
    """The terms of one input's gradient (in the order of the inputs, as the plan's loads)."""
    k_terms: tuple  # (vector, derivative text): u, c, r and a per-channel log-decay gl (key channels)
    v_terms: tuple  # (vector, derivative text): z (value channels)
    g_term: str  # derivative of a scalar log-decay ("" where it does not depend on this input)


@dataclass(frozen=True)
class Chain:
    k_temps: tuple  # (name, text): shared subexpressions of the key-channel and log-decay terms
    v_temps: tuple  # (name, text): of the value-channel terms
    grads: tuple  # InputGrad, one per input
    log_decay: str  # unfloored log-decay text ("" without a data-dependent decay): where it is
    # below the kernels' floor, its gradient is zero
    solve: bool = False  # the offline solve's: the vectors kk and lam too
    # key-channel vectors beyond u, c, r and gl the kernel reads, in its argument order: the solve's
    # kk and lam, each auxiliary state's write aw_P (the gradient of the scan's input; its decay's,
    # ad_P, the kernel makes: aw_P times the state before the token)
    extra: tuple = ()
    aux: tuple = ()  # (name, terms): each auxiliary state and its local gradient's (vector, text)
    # value-channel inputs whose gradient is the write value's itself (z is the input, read per
    # value head and not clamped): the host hands dz over as it is, the kernel neither reads nor
    # copies it (gated_deltanet's v: a [B, T, HV, V] read and write saved)
    v_given: tuple = ()
    v_loop: bool = True  # some gradient still needs dz (the kernel's loop over value tiles)
    # where every input's gradient is one vector's own (linear attention, RetNet, Mamba-2: q, k, v
    # and a log-decay input read as they are): (input, vector, lo, hi) per input, lo and hi the
    # declared range's literals of a log-decay input ("" where open); else (). Then no kernel runs:
    # the staged backward scales r's gradient itself (r = q * scale), the host masks the log-decay's
    # where the input was clamped or floored and casts (chain_rule.py.jinja)
    direct: tuple = ()
    # inputs whose gradient no one reads (the split's phase, codegen/split.py): no terms, no store
    skip: tuple = ()

    @property
    def inputs_text(self) -> str:
        """The host's loop over the inputs with gradients (chain_rule.py.jinja), as Python text."""
        return f"(n for n in INPUTS if n not in {self.skip})" if self.skip else "INPUTS"

    def made_from(self, loads: tuple, vector: str):
        """The key-channel load (of `loads`, the inputs' order) whose gradient is `vector`'s gradient
        alone times a number, where no other input's gradient (nor a shared term, nor the
        log-decay's) reads `vector`'s or that input: the kernel that makes `vector`'s gradient can
        make that input's there (plan.chain_at_dr, plan.chain_at_dc). Else None."""
        pairs = list(zip(loads, self.grads))
        for l, g in pairs:
            if (l.kind == "K" and len(g.k_terms) == 1 and g.k_terms[0][0] == vector and _is_number(g.k_terms[0][1])
                    and not g.g_term and not g.v_terms):
                break
        else:
            return None
        others = [h for m, h in pairs if m is not l]
        if any(v == vector for h in others for v, _ in h.k_terms):
            return None
        texts = [t for _, t in self.k_temps] + [self.log_decay] + [h.g_term for h in others]
        texts += [t for h in others for _, t in (*h.k_terms, *h.v_terms)]
        if any(re.search(rf"\b{l.var}\b", t) for t in texts):  # _chain_tokens would still load it
            return None
        return l


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _lower(exprs: list, prefix: str, taken: set):
    """cse over exprs: (temporaries as (variable, text), texts of the reduced expressions). The
    temporaries' names avoid every name of the spec."""
    while any(n.startswith(prefix) for n in taken):
        prefix = "x" + prefix
    names = (sp.Symbol(f"{prefix}{i}", real=True) for i in range(10**6))
    temps, reduced = sp.cse(exprs, symbols=names, optimizations=None)
    return (tuple((var(s.name), code(e)) for s, e in temps), [code(e) for e in reduced])


def chain(m: ir.Mixer) -> Chain | None:
    """The generated chain rule for a staged or offline-solve spec, or None where it cannot be
    generated."""
    names = {a.name for a in m.aux}
    if any(a.kind != "K" or (a.decay.free_symbols | a.write.free_symbols) & {ir.symbol(n) for n in names}
           for a in m.aux):
        return None
    before = fused(m)  # the staged kernels read S_prev^T r, c the bonus's key vector
    kv = {"u": m.write.key, "r": before.query if before else m.query}
    if m.delta is not None:
        kv["c"] = m.delta.c
    elif before is not None and before.bonus_key is not None:
        kv["c"] = before.bonus_key
    if m.solve_lam is not None:
        kv["kk"] = next(i.symbol for i in m.inputs if i.name == "k")
        kv["lam"] = m.solve_lam
    if m.decay.kind == "diagonal":  # a key-channel vector like the others
        kv["gl"] = m.log_decay()
    kv = {n: inlined(m, e) for n, e in kv.items()}
    z = inlined(m, m.write.value)
    gl = inlined(m, m.log_decay()) if m.decay.kind == "scalar" else None
    syms = [ir.symbol(a.name) for a in m.aux]
    if any(s in e.free_symbols for s in syms for e in [z, *([gl] if gl is not None else []),
                                                         *(inlined(m, a.decay) for a in m.aux),
                                                         *(inlined(m, a.write) for a in m.aux)]):
        return None
    # the state's own derivatives, while the vectors are the ones P reaches; then its write and decay
    p_parts = [[(n, d) for n, d in ((n, sp.diff(e, s)) for n, e in kv.items()) if d != 0] for s in syms]
    for a in m.aux:
        kv["aw_" + a.name] = inlined(m, a.write)
        kv["ad_" + a.name] = inlined(m, a.decay)
    # every derivative, per input: key-channel ones (and the log-decay's), value-channel ones
    k_parts, v_parts = [], []
    skip = (m.split_phase,) if m.split_phase else ()
    for i in (*m.inputs, *m.params):  # in the order of the plan's loads
        kt = [(n, d) for n, d in ((n, sp.diff(e, i.symbol)) for n, e in kv.items()) if d != 0]
        gd = sp.diff(gl, i.symbol) if gl is not None else sp.Integer(0)
        if i.name in skip:
            kt, gd = [], sp.Integer(0)
        k_parts.append((kt, gd))
        v_parts.append([d for d in [sp.diff(z, i.symbol)] if d != 0 and i.name not in skip])
    k_exprs = [d for kt, gd in k_parts for d in [d for _, d in kt] + ([gd] if gd != 0 else [])]
    k_exprs += [d for pt in p_parts for _, d in pt]
    v_exprs = [d for vt in v_parts for d in vt]
    try:
        k_temps, k_texts = _lower(k_exprs, "cse_k", set(m.kinds()))
        v_temps, v_texts = _lower(v_exprs, "cse_v", set(m.kinds()))
        raw_gl = code(gl) if gl is not None else code(kv["gl"]) if "gl" in kv else ""
    except TypeError:  # a derivative texpr has no lowering for: the PyTorch chain rule stays
        return None
    k_texts, v_texts = iter(k_texts), iter(v_texts)
    grads = tuple(InputGrad(k_terms=tuple((n, next(k_texts)) for n, _ in kt),
                            v_terms=tuple(("z", next(v_texts)) for _ in vt),
                            g_term=next(k_texts) if gd != 0 else "")
                  for (kt, gd), vt in zip(k_parts, v_parts))
    aux = tuple((a.name, tuple((n, next(k_texts)) for n, _ in pt)) for a, pt in zip(m.aux, p_parts))
    # (the decay's ad_P is not read: the kernel makes it from aw_P and the state before the token)
    extra = (("kk", "lam") if m.solve_lam is not None else ()) + tuple("aw_" + a.name for a in m.aux)
    # z's symbol is the input as the kernels read it: clamped into its range, or normalised (an
    # L2-normalised value is not staged today, but its gradient would not be dz either)
    v_given = tuple(i.name for i in m.inputs if i.kind == "V" and not i.shared and sp.diff(z, i.symbol) == 1
                    and not i.l2norm and not i.clamped)
    v_loop = any(vt for i, vt in zip((*m.inputs, *m.params), v_parts) if i.name not in v_given)
    return Chain(k_temps, v_temps, grads, raw_gl, solve=m.solve_lam is not None, v_given=v_given, v_loop=v_loop,
                 extra=extra, aux=aux, direct=_direct(m, gl, k_parts, v_parts, v_given), skip=skip)


def _direct(m: ir.Mixer, gl, k_parts: list, v_parts: list, v_given: tuple) -> tuple:
    """Chain.direct: each input's gradient is one vector's, no two inputs share a vector, and no
    input is normalised or clamped but a scalar log-decay input (its gradient is the log-decay's,
    masked). A decay per key channel keeps the kernel (its backward's vector gradients are fp32)."""
    if m.params or m.aux or m.solve_lam is not None or m.decay.kind == "diagonal":
        return ()
    out = []
    for i, (kt, gd), vt in zip(m.inputs, k_parts, v_parts):
        if i.kind == "V" and not kt and gd == 0 and i.name in v_given:
            out.append((i.name, "z", "", ""))
        elif (i.kind == "K" and len(kt) == 1 and kt[0][1] == 1 and kt[0][0] in ("u", "c", "r") and gd == 0
              and not vt and not i.l2norm and not i.clamped):
            out.append((i.name, kt[0][0], "", ""))
        elif (i.kind == "scalar" and not i.shared and not kt and not vt and gl is not None
              and sp.simplify(gl - i.symbol) == 0):
            out.append((i.name, "gl", *(number(b) if b.is_finite else "" for b in (i.lo, i.hi))))
        else:
            return ()
    vectors = [vec for _, vec, _, _ in out]
    return tuple(out) if len(set(vectors)) == len(vectors) else ()
