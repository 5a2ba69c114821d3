"""The chunk pass as an affine map of its incoming state, shared by context parallelism (cp.py,
the pieces on different ranks) and the segmented pass on one device (segments.py, the pieces in
one call).

Over any run of tokens S_out = L S_in + R (L [n, HV, K, K], R [n, HV, K, V] per sequence), and each
auxiliary state (ATK's P) is an elementwise first-order scan, P_out = l * P_in + r, whose
coefficients do not depend on S. The maps come from chunk calls over the pieces:
 - `aux_maps`: one call from two auxiliary starts a unit apart (one value channel will do);
 - `wide_run`: where `widens`, one call with K more value columns (v = 0 there, their incoming state
   the identity) gives the final state [R | L] and, beside o, each token's readout C_t of the
   incoming state, so that o and the final state are finished by `finish` once S_in is known;
 - `fallback_maps`: otherwise one batched call from 1 + ceil(K/V) starts, and the pieces run again
   from their true incoming states.
`prefix` composes maps in order; a piece whose sequence starts in it (its own initial state already
in R) cuts the composition there, so pieces of many sequences compose in one scan. Every step is a differentiable torch operation.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=64)
def values(m) -> tuple:
    """The value-channel inputs that carry the writes' values: v, and each further step's own value
    (DeltaProduct's v2, v3, ...)."""
    import sympy as sp
    inputs = {i.name for i in m.inputs if i.kind == "V"}
    named = {str(s) for st in m.steps for s in sp.sympify(m.inline_lets(st.write.value)).free_symbols}
    return ("v", *sorted(named & inputs - {"v"}))


@functools.lru_cache(maxsize=64)
def widens(m) -> bool:
    """Whether a piece's map can ride in one run beside its values: K more value columns with
    zero values (`values`) and the identity as their incoming state carry the transition's product (L)
    in their final state and each token's readout of the incoming state in o, because every value
    column evolves on its own under the same K x K transitions. That needs every write's value to
    vanish with the values (it does in every example) and 0 inside each one's range, not normalised;
    no auxiliary state per value channel, and no other value-channel input normalised or declared
    unit (its pad, a copy of channel 0, would change its norm). Otherwise the maps take one batched
    run and the piece a second one."""
    import sympy as sp

    from lrdsl.frontend.ir import symbol
    if m.bonus or m.side != "left":  # a dot-product readout is not linear in the incoming state; a
        return False                 # value-side transition mixes the value columns
    zeroed = values(m)
    for name in zeroed:
        x = m.input(name)
        if (x.lo > 0 or x.hi < 0 or (x.lo == 0 and x.lo_open) or (x.hi == 0 and x.hi_open)
                or (name != "v" and (x.l2norm or x.unit))):
            return False
    if (any(a.kind == "V" for a in m.aux)
            or any(i.kind == "V" and i.name not in zeroed and (i.l2norm or i.unit) for i in m.inputs)):
        return False
    zero = {symbol(n): 0 for n in zeroed}
    return all(sp.simplify(m.inline_lets(w.value).xreplace(zero)) == 0
               for w in (m.write, *(st.write for st in m.steps)))


def widen(m, x: dict, K: int) -> dict:
    """x with K more value channels: zeros in the values (`values`), a copy of channel 0 (detached:
    in range, and the write there is zero whatever it holds) in every other value-channel input and
    param."""
    kinds, zeroed = m.kinds(), values(m)
    out = dict(x)
    for n, t in x.items():
        if n in zeroed:  # one write of the wide tensor (zeros_like of an expanded view fills a whole
            out[n] = torch.nn.functional.pad(t, (0, K))  # tensor first, which the cat then reads)
        elif kinds[n] == "V":
            out[n] = torch.cat([t, t[..., :1].detach().expand(*t.shape[:-1], K)], -1)
    return out


def narrow(m, x: dict) -> dict:
    """x with value channel 0 alone (for the auxiliary maps: auxiliary states per key channel never
    read a value channel)."""
    kinds = m.kinds()
    return {n: (t[..., :1] if kinds[n] == "V" else t) for n, t in x.items()}


def copies(x: dict, c: int, per_token: set) -> dict:
    """c copies of the batch x side by side along the batch (params once)."""
    return {n: (torch.cat([t] * c) if n in per_token else t) for n, t in x.items()}


def aux_maps(m, run, x2: dict, lo: list, hi: list) -> tuple:
    """(l, r) of every auxiliary state over x's sequences, from one call over x2 (two copies of x,
    made by the caller) starting from lo and from hi = lo + 1 (where hi = lo, l = 0 there).
    run(x, S, aux) -> (o, final S, final aux list)."""
    n = lo[0].shape[0]
    x2 = x2 if any(a.kind == "V" for a in m.aux) else narrow(m, x2)
    v = x2["v"]
    S = torch.zeros(2 * n, v.shape[2], x2["k"].shape[-1], v.shape[-1], device=v.device, dtype=torch.float32)
    _, _, f = run(x2, S, [torch.cat([a, b]) for a, b in zip(lo, hi)])
    return [a[n:] - a[:n] for a in f], [a[:n] for a in f]


def wide_run(m, run, x: dict, A, E, aux_in: list) -> tuple:
    """One call over x with K more value columns from [A | E]: (o with K more channels, R, L, final
    aux). E is the identity where the map is wanted (zero where the piece starts its sequence)."""
    V = A.shape[-1]
    o, F, aux = run(widen(m, x, E.shape[-1]), torch.cat([A, E], -1), aux_in)
    R, L = F.split([V, E.shape[-1]], -1)  # (one op back: slices' gradients are each a zero-filled F)
    return o, R, L, aux


def finish(o_w, V: int, S):
    """o from the wide run's [o | C] and the incoming states S [n, HV, K, V]: o + C S, in o's dtype.
    In bf16 or fp16 the product takes S in that dtype too (fp32 sums), as the kernels' own readout
    of the state does: fp32 copies of C and o cost more than the whole state pass they shorten.
    On plain tensors `_Finish` reads C and o in place (no copies of the halves, no zero gradient
    of the wide output); under torch.compile, torch.func or a dispatch mode, the einsum below."""
    from lrdsl.runtime.autograd import eager
    if o_w.dtype in (torch.bfloat16, torch.float16):
        if eager([o_w, S]):
            return _Finish.apply(o_w, V, S)
        return o_w[..., :V] + torch.einsum("bthk,bhkv->bthv", o_w[..., V:], S.to(o_w.dtype))
    return (o_w[..., :V].float() + torch.einsum("bthk,bhkv->bthv", o_w[..., V:].float(), S)).to(o_w.dtype)


def _heads(x, i: int, by_head: bool):
    """Rows of x [n, t, HV, c] as one batch of matrices [., t, c] without a copy: head i of every
    piece (by_head) or every head of piece i; either way each matrix has unit column stride and one
    row stride, as a batched GEMM reads them in place."""
    return x[:, :, i] if by_head else x[i].transpose(0, 1)


def _piece(x, i: int, by_head: bool):
    """x [n, HV, ...] at head i of every piece (by_head) or at piece i: the maps beside `_heads`."""
    return x[:, i] if by_head else x[i]


class _Finish(torch.autograd.Function):
    """o = o_w[..., :V] + C S per piece and head, in a loop over the heads or over the pieces
    (whichever is shorter), each a batched GEMM on strided views: the output gets one write, C is
    read in place, and the backward writes the wide output's gradient [dO | dO S^T] once. One
    rounding of each output (baddbmm adds o in fp32) where the einsum rounds twice."""

    @staticmethod
    def forward(ctx, o_w, V, S):
        n, t, HV, _ = o_w.shape
        by_head = HV <= n
        Sd = S.to(o_w.dtype)
        o = torch.empty(n, t, HV, V, dtype=o_w.dtype, device=o_w.device)
        for i in range(HV if by_head else n):
            w = _heads(o_w, i, by_head)
            torch.baddbmm(w[..., :V], w[..., V:], _piece(Sd, i, by_head), out=_heads(o, i, by_head))
        ctx.V, ctx.by_head, ctx.S_dtype = V, by_head, S.dtype
        ctx.save_for_backward(o_w, Sd)
        return o

    @staticmethod
    def backward(ctx, do):
        o_w, Sd = ctx.saved_tensors
        V, by_head = ctx.V, ctx.by_head
        if torch.is_grad_enabled():  # a second derivative: out= writes are not differentiable
            with torch.enable_grad():
                o = o_w[..., :V] + torch.einsum("bthk,bhkv->bthv", o_w[..., V:], Sd)
            g_o, g_S = torch.autograd.grad(o, (o_w, Sd), do, create_graph=True)
            return g_o, None, g_S.to(ctx.S_dtype)
        do = do.to(o_w.dtype)
        d_w = torch.empty_like(o_w)
        d_w[..., :V].copy_(do)
        dS = torch.empty_like(Sd)
        for i in range(o_w.shape[2] if by_head else o_w.shape[0]):
            d_i = _heads(do, i, by_head)
            torch.bmm(d_i, _piece(Sd, i, by_head).transpose(-1, -2), out=_heads(d_w, i, by_head)[..., V:])
            torch.bmm(_heads(o_w, i, by_head)[..., V:].transpose(-1, -2), d_i, out=_piece(dS, i, by_head))
        return d_w, None, dS.to(ctx.S_dtype)


def fallback_maps(run, many, A, aux_in: list, through=None, right: bool = False) -> tuple:
    """(R, L) of x's sequences from one batched call from A and from A plus each block of up to V
    identity columns (1 + ceil(K/V) starts); many(c) is x's c copies side by side; `through` ([n] of
    0/1, None for all ones) zeroes the identity, hence L, where a piece starts its sequence.
    right: a value-side transition, S_out = S_in L + R with L [V, V], from blocks of up to K identity
    rows (1 + ceil(V/K) starts); compose those with `right_mul`."""
    n, _, K, V = A.shape
    starts, cols = [A], []
    for b0 in range(0, V if right else K, K if right else V):
        w = min(K, V - b0) if right else min(V, K - b0)
        E = torch.zeros_like(A)
        r = torch.arange(w, device=A.device)
        if right:
            E[..., r, b0 + r] = 1.0
        else:
            E[..., b0 + r, r] = 1.0
        starts.append(A + (E if through is None else E * through[:, None, None, None]))
        cols.append(w)
    c = len(starts)
    _, F, _ = run(many(c), torch.cat(starts), [torch.cat([a] * c) for a in aux_in])
    R = F[:n]
    if right:  # rows b0.. of L are the first w rows of that start's change
        return R, torch.cat([(F[(j + 1) * n:(j + 2) * n] - R)[..., :w, :] for j, w in enumerate(cols)], -2)
    L = torch.cat([(F[(j + 1) * n:(j + 2) * n] - R)[..., :w] for j, w in enumerate(cols)], -1)
    return R, L


def right_mul(L, X):
    """`prefix`'s mul for value-side maps: X L (the map of the piece after X's)."""
    return torch.matmul(X, L)


def prefix(L, R, mul=torch.matmul, starts=None):
    """Inclusive compositions of the maps along dim 0: R[j] becomes the state after piece j from the
    state before the first piece of its run, i.e. R_j + L_j (R_{j-1} + L_{j-1} (...)). starts (n
    bools on the host, None for none): pieces that begin a run (their sequence starts in them), where
    the composition stops whatever came before (the state entering such a piece is zero, not the
    state before multiplied by a zero map: a nan or inf of one sequence stays out of the next). mul:
    matmul for S, elementwise for auxiliary states."""
    return incoming(L, R, mul, starts)[1]


def incoming(L, R, mul=torch.matmul, starts=None) -> tuple:
    """(S_in, S_out) of the pieces along dim 0: S_out as `prefix` gives it, S_in[j] the state
    entering piece j from the pieces before it in its run (S_out[j - 1], zero where piece j begins
    a run, and for the first piece). A walk in order, one product and add per piece that continues
    a run (none where one starts: the host knows which), on unbound rows stacked at the end: the
    pieces number a few to some tens, and the backward of a log-depth scan's slices and
    concatenations (a zero-filled gradient of the whole stack for each slice) cost several times
    its launches and host time (2026-12-07)."""
    n = L.shape[0]
    Ls, Rs = L.unbind(0), R.unbind(0)
    stops = [False] * n if starts is None else [bool(s) for s in starts]
    zero = torch.zeros_like(Rs[0])
    outs, ins = [Rs[0]], [zero]
    for j in range(1, n):
        ins.append(zero if stops[j] else outs[-1])
        outs.append(Rs[j] if stops[j] else _step(mul, Rs[j], Ls[j], outs[-1]))
    return torch.stack(ins), torch.stack(outs)


def _step(mul, R, L, S):
    """R + mul(L, S) in one operation where there is one (torch.matmul's own reshapes and views cost
    more host time than its product on these small maps)."""
    if mul is torch.mul:
        return torch.addcmul(R, L, S)
    if R.dim() == 3 and mul in (torch.matmul, right_mul):
        return torch.baddbmm(R, L, S) if mul is torch.matmul else torch.baddbmm(R, S, L)
    return R + mul(L, S)
