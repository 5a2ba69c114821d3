"""Two tokens for one: a transition whose erase is not along the write key, as one whose erase is.

The staged kernels need the erase direction to be the write key (a = u): the erase then becomes a
correction of the value. Two kinds of spec miss that: a decay per key channel after the erase,
D (I - a c^T) S + u z^T (in the chunk's decayed frame its erase direction carries one token's decay
fewer than its write key), and an erase direction that is another vector. Both are the left-order
a = u transition applied twice per token, with a phase p (0, then 1) that switches parts off:

    order "left":  (I - a c^T) D S          then  S + u z^T        (p = 0, then p = 1)
    order "right": (I - a c^T) S            then  D S + u z^T

    split: (I - w ((1 - p) c)^T) D^[p] S + w (p z)^T,  w = (1 - p) a + p u (w = u where a = u),

with D^[p] the decay in the phase that has it and 1 in the other (exp(gate(p, log d)): a product
p log d would be nan where log d is -inf, a reset). The output is read at the second token of each
pair. The split spec's kernels are generated like any other spec's. Phase 0 writes nothing (its value
is 0) and phase 1 erases nothing (its c is 0), so the split spec's states after phase 1 are the
original's, exactly.

`Mixer.chunk` runs its staged kernels on the spec's own [B, T, ...] tensors (runtime/split.py;
with_sub_tokens below): row r of the 2T sub-tokens reads token r // 2 of every input, the phase
r % 2 from a constant [2, H] tensor, o is stored and dO read at phase 1's rows, and each input's
gradient is stored at its token from the phase it lives in (grad_phases) or at every row and
summed. Where that route does not apply (runtime/split.py's in_place) chunk interleaves the
tensors (each token twice, the phase beside them: interleave, phases) and slices o."""
from __future__ import annotations

import dataclasses

import sympy as sp

from lrdsl.frontend import ir
from lrdsl.frontend.primitives import gate, inlined
from lrdsl.frontend.symbolic import simplified


def not_staged(m: ir.Mixer) -> str:
    """Why the staged forward does not cover this spec ("" when it does).

    The staged forward writes the erase as a correction of the value: with a = u (the erase
    direction is the write key, as in every delta-rule model), (I - a c^T) D S + a z^T
    = D S + a (z - c^T D S)^T, so one pairwise matrix and one solve give the corrected values."""
    if m.side != "left":
        return "a value-side transition (S N or M S N) takes kernels of its own"
    if m.delta is not None and m.delta.order == "right":
        return "a decay after the erase takes the general kernels"
    if m.delta is not None and simplified(m.delta.a - m.write.key) != 0:
        return "the erase direction differs from the write key"
    if any(i.l2norm and i.kind == "V" for i in m.inputs):
        return "an L2 norm over the value channels needs whole rows"
    return ""


def split_ir(m: ir.Mixer) -> ir.Mixer | None:
    """The split mixer of m, or None where m has the staged kernels already or the split has none
    either (auxiliary states would advance twice; the offline solve has kernels of its own)."""
    if m.delta is None or m.aux or m.solve_lam is not None or m.side != "left" or not not_staged(m):
        return None
    phase = ir.Input(_free_name(m, "phase"), "scalar", shared=True, l2norm=False, unit=False, log=False,
                     lo=sp.Integer(0), hi=sp.Integer(1), lo_open=False, hi_open=False)
    p = phase.symbol
    a, c, u = m.delta.a, m.delta.c, m.write.key
    key = u if simplified(a - u) == 0 else (1 - p) * a + p * u
    decays = p if m.delta.order == "right" else 1 - p  # the phase that has the decay
    order = "sum" if m.delta.order == "sum" else "left"  # (D - a c^T) S, then S + u z^T
    decay = m.decay
    if decay.kind != "identity":
        kind = "diagonal" if decay.kind == "diagonal" else "scalar"
        decay = ir.Decay(kind, sp.exp(gate(decays, m.log_decay())))
    out = dataclasses.replace(m, name=m.name + "_split", inputs=(*m.inputs, phase), decay=decay,
                              delta=ir.Delta(key, (1 - p) * c, order), write=ir.Write(key, p * m.write.value),
                              split_phase=phase.name)
    return None if not_staged(out) else out


def with_sub_tokens(m: ir.Mixer, p):
    """Plan p of a split mixer with its two sub-tokens read in place (plan.sub_tokens = 2): every
    input but the phase at token r // 2 of its own [B, T, ...] tensor (plan.sub_reads), the phase as
    the one step input (plan.sub_steps), from a constant [2, H] tensor with token stride 0, and o
    stored at phase 1's rows alone (plan.sub_out). Only where the staged forward reads the inputs
    through _staged_k, _staged_v and the raw query's holes alone: plans with raw keys, values or
    WY tiles, or a decay prefix launch, keep the interleaved tensors (none of the examples has
    them). The kernels' sub_n = 1 reads interleaved tensors as before (the runtime's other routes)."""
    if not m.split_phase or not p.staged or p.raw or p.raw_key or p.raw_value or p.raw_wy or p.decay_prefix:
        return p
    reads = tuple(l.name for l in p.loads if l.name != m.split_phase and not l.per_head)
    return dataclasses.replace(p, sub_tokens=2, sub_steps=(m.split_phase,), sub_reads=reads,
                               sub_once=tuple((x, j) for x, j in grad_phases(m) if x in reads))


def grad_phases(m: ir.Mixer) -> tuple:
    """(input, phase) of each input of split mixer m whose gradient is zero in the other phase:
    every derivative of the per-token vectors (u, c, z, the log-decay, and r in phase 1: o is read
    there alone, so r's gradient is zero in phase 0) by the input, with the phase substituted,
    simplifies to 0 (sympy). rwkv7: q, k, v in phase 1, w, kk, a in phase 0; kda_decay_after_erase's
    k and beta have both."""
    p = ir.symbol(m.split_phase)
    vectors = [m.write.key, m.write.value] + ([m.delta.c] if m.delta is not None else [])
    vectors += [m.log_decay()] if m.decay.kind != "identity" else []
    vectors = [inlined(m, e) for e in vectors]
    query = inlined(m, m.query)
    out = []
    for i in m.inputs:
        if i.name == m.split_phase:
            continue
        live = [j for j in (0, 1)
                if any(simplified(sp.diff(e, i.symbol).subs(p, j)) != 0 for e in vectors + ([query] if j else []))]
        if len(live) == 1:
            out.append((i.name, live[0]))
    return tuple(out)


def _free_name(m: ir.Mixer, base: str) -> str:
    taken = set(m.kinds())
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def interleave(t):
    """[B, T, ...] -> [B, 2T, ...], every token twice in a row. torch.stack, not a reshape of an
    expanded view: on the H200 its copy is 2.3x faster in bf16 (72 against 162 us for q at B=4
    T=4096 H=16 K=128), and its backward adds the two halves rather than summing over a dimension
    of 2 (94 against 144 us)."""
    import torch  # lazily, as everywhere outside the kernels' paths: `lrdsl show` needs no torch
    B, T = t.shape[:2]
    return torch.stack((t, t), 2).view(B, 2 * T, *t.shape[2:])


def phases(B: int, T: int, H: int, like):
    """The phase input [B, 2T, H]: 0 at the first token of each pair, 1 at the second."""
    import torch
    p = torch.arange(2 * T, device=like.device) % 2
    return p.to(like.dtype)[None, :, None].expand(B, 2 * T, H).contiguous()
