"""Context parallelism: one `mixer.chunk` call over sequences split along T across a process group.

Each rank holds a contiguous slice of the tokens (batched: [B, T_r, ...] of every sequence; packed:
a slice of the packed sequence, the global cu_seqlens on every rank, so sequences may straddle
ranks). The chunk pass is affine in its incoming state: over a rank's tokens S_out = L S_in + R
(L [HV, K, K] and R [HV, K, V] per carried sequence), and each auxiliary state (ATK's P) is an
elementwise first-order scan, P_out = l * P_in + r, whose coefficients do not depend on S. So:

 1. the auxiliary maps (l, r) of every rank are all-gathered and composed in rank order, giving the
    auxiliary state that enters each rank;
 2. with it, the sequence that continues from the left (the head) runs once with K more value
    columns, v = 0 there and the identity as their incoming state: every value column evolves on its
    own under the same K x K transitions, so the final state is [R | L] (R from a zero incoming S)
    and o is [o from a zero S | each token's readout C_t of the incoming state] (`widens` says when
    a spec allows it; otherwise one batched run from a zero and identity-like incoming states gives
    R and L, and the head runs again from its true incoming state after step 3);
 3. the (L, R) of every rank are all-gathered (fp32) and composed in rank order: S_in of rank r is
    L_{r-1}(... (L_0 S + R_0) ...) + R_{r-1}, reset to R_i at a rank whose carried sequence starts
    on it (L_i = 0);
 4. the head's o is o_0 + C S_in and its final state L S_in + R.
A rank thus runs each of its tokens once (the head at V + K value columns), plus, where its state is
carried on and the spec has auxiliary states, one call for their maps (a batch of two starts at one
value channel), and all ranks run at once: none waits for another's chunk pass.
Only the head takes an incoming state; the other sequences run from their own initial states.
Every step is a differentiable torch operation (chunk differentiates through its inputs and its
whole initial state; torch.distributed.nn's all_gather carries gradients back to the rank that
sent the map), so the backward follows by autograd. Communication per rank: one gather of the
slice lengths with a fingerprint of the arguments that must agree (`agree`), and one or two
gathers of K*K + K*V (+ the auxiliary widths) floats per head and carried sequence from each rank:
independent of T.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lrdsl.errors import InputError
from lrdsl.runtime.affine import aux_maps, copies, fallback_maps, finish, prefix, wide_run, widens

__all__ = ["chunk", "pieces", "widens"]


@dataclass(frozen=True)
class Piece:
    """How one rank's slice meets the sequences: the global indices first..last of the sequences it
    holds (a batch: all of them), local cu_seqlens (None for a batch), whether its first sequence
    continues from the rank before (`from_left`) and whether its last one is that same sequence,
    so its outgoing state depends on its incoming one (`through`)."""
    first: int
    last: int
    cu: tuple | None
    from_left: bool
    through: bool


def pieces(cu: list | None, B: int, lengths: list) -> list:
    """The Piece of every rank, from the global cu_seqlens (None for a batch) and the slice lengths.
    An empty sequence belongs to the rank that holds the token at its position (the last rank at the
    end)."""
    out, off = [], 0
    for r, n in enumerate(lengths):
        end = off + n
        if cu is None:
            out.append(Piece(0, B - 1, None, r > 0, r > 0))
            off = end
            continue
        last_rank = r == len(lengths) - 1
        mine = [j for j in range(len(cu) - 1)
                if (cu[j] < cu[j + 1] and cu[j] < end and cu[j + 1] > off)
                or (cu[j] == cu[j + 1] and (off <= cu[j] < end or (last_rank and cu[j] == end)))]
        first, last = mine[0], mine[-1]
        local = tuple(min(max(c, off), end) - off for c in cu[first:last + 2])
        from_left = cu[first] < off
        out.append(Piece(first, last, local, from_left, from_left and first == last))
        off = end
    return out


def check_group(group) -> None:
    """cp_group must be a process group of an initialised torch.distributed (torch's own message for
    anything else speaks of a default group or of attributes, not of cp_group)."""
    import torch.distributed as dist
    if not dist.is_available():
        raise InputError("cp_group needs torch.distributed, which this PyTorch build lacks; call chunk "
                         "without cp_group")
    if not isinstance(group, dist.ProcessGroup):
        raise InputError(f"cp_group must be a torch.distributed process group (dist.group.WORLD or one "
                         f"made by dist.new_group after dist.init_process_group), not {type(group).__name__}")


def _refuse(mixer) -> None:
    m = mixer.ir
    if m.solve_lam is not None:
        raise InputError(f"mixer '{m.name}' reads its state through an offline solve, which context "
                         "parallelism does not carry across ranks: call chunk without cp_group")
    names = {a.name for a in m.aux}
    for a in m.aux:
        used = {str(s) for e in (a.decay, a.write) for s in e.free_symbols} & names
        if used:
            raise InputError(f"mixer '{m.name}': auxiliary state {a.name!r} is updated from "
                             f"{sorted(used)[0]!r}, another auxiliary state, which context parallelism "
                             "does not carry across ranks: call chunk without cp_group")


def _local_error(mixer, q, k, v, scale, cu_seqlens, inputs):
    """This rank's own mistake (an InputError, not raised yet) or None: the spec refused, cu_seqlens
    not offsets, its slice of the inputs not fitting the spec. Raised only after the ranks have
    compared their arguments, so that no rank is left waiting in a collective for one that stopped."""
    from lrdsl.runtime.tensors import check_cu_seqlens, validate
    try:
        _refuse(mixer)
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens)
        validate(mixer.ir, q, k, v, inputs, scale)  # the slice alone: packed, it is a batch of one
    except InputError as e:
        return e
    return None


# What `agree` gathers from every rank, one float64 each (integers and 48-bit hashes are exact):
# (name, how ranks may differ: "any" / "same" / "close", what the error calls it)
FIELDS = [("error", "any", ""), ("T", "any", ""),
          ("B", "same", "the batch size B"), ("H", "same", "the heads H of q and k"),
          ("HV", "same", "the heads HV of v"), ("K", "same", "the key size K"), ("V", "same", "the value size V"),
          ("spec", "same", "the spec"), ("dtypes", "same", "the inputs' dtypes"),
          ("scale", "same", "scale"), ("cu", "same", "cu_seqlens"),
          ("state", "same", "the kind, shapes and dtypes of initial_state"),
          ("state_sum", "close", "the values of initial_state"), ("state_sq", "close", "the values of initial_state"),
          ("state_w", "close", "the values of initial_state"), ("params", "same", "the shapes of the params"),
          ("param_sum", "close", "the values of the params"), ("param_sq", "close", "the values of the params"),
          ("param_w", "close", "the values of the params")]


def _hash48(text: str) -> float:
    import hashlib
    return float(int(hashlib.sha256(text.encode()).hexdigest()[:12], 16))


def _moments(tensors, device) -> list:
    """Sum, sum of squares and a position-weighted sum of the tensors' entries (float64, on the
    device): equal tensors give equal numbers; a changed, moved or swapped entry changes them."""
    flat = [t.detach().reshape(-1).double() for t in tensors]
    x = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64, device=device)
    w = torch.linspace(1.0, 2.0, x.numel(), dtype=torch.float64, device=x.device)
    return [x.sum(), (x * x).sum(), (x * w).sum()]


def agree(mixer, q, k, v, scale, initial_state, cu_seqlens, inputs, group, local_error) -> list:
    """Every rank's slice length, after one all_gather of a fixed-size fingerprint of the arguments
    that must agree across ranks (sizes, dtypes, spec, scale, cu_seqlens, initial_state, params):
    ranks that disagree (or any rank with a mistake of its own) raise the same InputError on every
    rank, instead of computing a wrong answer in silence or aborting inside the backend on
    collectives of different sizes."""
    import math

    from lrdsl.frontend import printer
    from lrdsl.runtime.tensors import MixerState
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    row = {name: 0.0 for name, _, _ in FIELDS}
    parts, params = [], []
    if local_error is not None:
        row["error"] = 1.0
    else:
        row["T"] = q.shape[1]
        row["B"], row["H"], row["K"] = q.shape[0], q.shape[2], q.shape[3]
        row["HV"], row["V"] = v.shape[2], v.shape[3]
        row["spec"] = _hash48(printer.explicit(mixer.ir))
        given = dict(inputs, q=q, k=k, v=v)
        pnames = {p.name for p in mixer.ir.params}
        row["dtypes"] = _hash48(",".join(f"{n}:{given[n].dtype}" for n in sorted(given)))
        row["scale"] = _hash48("None" if scale is None else repr(float(scale)))
        row["cu"] = _hash48("None" if cu_seqlens is None else repr([int(c) for c in cu_seqlens.tolist()]))
        if isinstance(initial_state, MixerState) and isinstance(initial_state.aux, dict):
            parts = [("S", initial_state.S), *sorted(initial_state.aux.items(), key=lambda a: str(a[0]))]
        elif initial_state is not None:
            parts = [("tensor", initial_state)]
        if any(not isinstance(t, torch.Tensor) or t.is_meta for _, t in parts):
            row["state"] = -1.0  # not tensors: the later shape check says so, on every rank alike
            parts = []
        else:
            row["state"] = _hash48(repr([(n, tuple(t.shape), str(t.dtype)) for n, t in parts]
                                        if initial_state is not None else None))
        params = [(n, given[n]) for n in sorted(pnames & set(given))]
        row["params"] = _hash48(repr([(n, tuple(t.shape)) for n, t in params]))
    with torch.no_grad():
        numbers = [torch.tensor(row[name], dtype=torch.float64, device=dev) for name, _, _ in FIELDS]
        index = {name: i for i, (name, _, _) in enumerate(FIELDS)}
        for prefix, tensors in (("state", [t for _, t in parts]), ("param", [t for _, t in params])):
            for suffix, x in zip(("sum", "sq", "w"), _moments(tensors, dev)):
                numbers[index[f"{prefix}_{suffix}"]] = x.to(dev)
        table = _gather(torch.stack(numbers), group, False).cpu().tolist()
    bad = [r for r, t in enumerate(table) if t[index["error"]]]
    if bad:
        if local_error is not None:
            raise local_error
        raise InputError(f"context parallelism: rank{'s' if len(bad) > 1 else ''} "
                         f"{', '.join(map(str, bad))} refused {'their' if len(bad) > 1 else 'its'} "
                         "arguments (its error says why), so every rank stops")
    for name, how, what in FIELDS:
        i = index[name]
        values = [t[i] for t in table]
        if how == "any":
            continue
        if how == "same":
            differ = any(x != values[0] for x in values)
        else:
            differ = any(not (math.isclose(x, values[0], rel_tol=1e-9, abs_tol=1e-12)
                              or (math.isnan(x) and math.isnan(values[0]))) for x in values)
        if differ:
            other = [str(r) for r, x in enumerate(values) if x != values[0]]
            shown = (f": {', '.join(f'rank {r} has {int(x)}' for r, x in enumerate(values))}"
                     if name in ("B", "H", "HV", "K", "V") else
                     f" (rank{'s' if len(other) > 1 else ''} {', '.join(other)} "
                     f"differ{'' if len(other) > 1 else 's'} from rank 0)")
            raise InputError(f"context parallelism: the ranks disagree on {what}{shown}; every rank must "
                             "pass the same spec, batch size, head sizes, dtypes, scale, the global "
                             "cu_seqlens, the global initial_state and the same params")
    return [int(t[index["T"]]) for t in table]


class _Tie(torch.autograd.Function):
    """x, with `others` in its autograd graph (zero gradient). Every rank must run the backward of
    every all_gather, in the same order, whatever it differentiates for: the results are tied to the
    gathered maps, the maps of the state to those of the auxiliary states, and what each rank sends to
    every tensor it could differentiate for (torch.autograd.grad runs only the paths to its inputs)."""
    @staticmethod
    def forward(ctx, x, *others):
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g, *_):
        return (g, *(torch.zeros((), dtype=d, device=dev).expand(s) for s, d, dev in ctx.shapes))


def _tie(x, *others):
    live = [o for o in others if o.requires_grad]
    return _Tie.apply(x, *live) if live else x


class _AllGather(torch.autograd.Function):
    """[world, *t.shape]: every rank's t. Backward: each rank's piece takes the sum over the ranks of
    their gradients of it (an all_reduce of the stacked gradient: gloo has no reduce_scatter)."""
    @staticmethod
    def forward(ctx, t, group):
        import torch.distributed as dist
        ctx.group = group
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t.contiguous(), group=group)
        return torch.stack(out)

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[dist.get_rank(ctx.group)], None


def _gather(t, group, grad: bool):
    """all_gather of t over the group, through autograd where grad (the same on every rank)."""
    if not grad:
        with torch.no_grad():
            return _AllGather.apply(t, group)
    return _AllGather.apply(t, group)


def chunk(mixer, q, k, v, scale, initial_state, output_final_state, cu_seqlens, inputs, group):
    """mixer.chunk(..., cp_group=group): this rank's o [B, T_r, HV, V] and, with output_final_state,
    the state after this rank's last token of each of its sequences (a batch: [B, ...]; packed: the
    sequences first..last it holds, in order; a sequence's final state is on the rank holding its
    last token). initial_state and cu_seqlens are the global ones, the same on every rank."""
    import torch.distributed as dist

    from lrdsl.runtime.tensors import MixerState
    local_error = _local_error(mixer, q, k, v, scale, cu_seqlens, inputs)
    try:
        check_group(group)
    except InputError as e:  # no group to tell the others through: this rank's own mistake first
        raise (local_error or e) from None
    rank = dist.get_rank(group)
    dev = q.device
    lengths = agree(mixer, q, k, v, scale, initial_state, cu_seqlens, inputs, group, local_error)
    cu = None if cu_seqlens is None else [int(c) for c in cu_seqlens.tolist()]
    if min(lengths) < 1:
        raise InputError(f"context parallelism needs at least one token on every rank; the slices "
                         f"have lengths {lengths}")
    if cu is not None and (len(cu) < 2 or cu[0] != 0 or cu[-1] != sum(lengths)
                           or any(b < a for a, b in zip(cu, cu[1:]))):
        raise InputError(f"with cp_group, cu_seqlens are the global ones: they must start at 0, never "
                         f"decrease and end at the total length {sum(lengths)} of the slices, got {cu}")
    B, HV, K, V = q.shape[0], v.shape[2], q.shape[3], v.shape[3]
    every = pieces(cu, B, lengths)
    me, world = every[rank], len(every)
    carries = rank + 1 < world and every[rank + 1].from_left
    N = B if cu is None else len(cu) - 1
    widths = [a.width(K, V) for a in mixer.ir.aux]

    # ---- the initial states of this rank's sequences (rows first..last of the global ones) -------
    S0, aux0 = initial_state, None
    if isinstance(initial_state, MixerState):
        S0 = initial_state.S
        aux0 = [initial_state.aux[a.name] for a in mixer.ir.aux] if mixer.ir.aux else None
    for t in [S0, *(aux0 or ())]:
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape[:2] != (N, HV)):
            raise InputError(f"with cp_group, initial_state holds the global sequences' states: "
                             f"[N, HV, ...] with N = {N}, the same on every rank")
    rows = slice(me.first, me.last + 1)
    S_rows = (torch.zeros(me.last + 1 - me.first, HV, K, V, device=dev) if S0 is None
              else S0[rows].float())
    aux_rows = [torch.zeros(S_rows.shape[0], HV, w, device=dev) if aux0 is None else a[rows].float()
                for a, w in zip(aux0 or [None] * len(widths), widths)]

    # ---- the local calls: `head` the rows that continue from the left, `rest` the others ---------
    per_token = {"q", "k", "v", *(i.name for i in mixer.ir.inputs)}
    names = [a.name for a in mixer.ir.aux]
    given = dict(inputs, q=q, k=k, v=v)
    leaves = [*given.values(), S0, *(aux0 or ())]
    leaves = [t for t in leaves if t is not None and t.requires_grad]
    grad = torch.is_grad_enabled() and bool(leaves)
    n_head = (B if cu is None else 1) if me.from_left else 0
    f32 = dict(device=dev, dtype=torch.float32)

    def run(x, S, aux, lcu=None):
        """chunk over x from whole initial states S, aux (fp32 rows): (o, final S, final aux list)."""
        h0 = MixerState(S, dict(zip(names, aux))) if widths else S
        lcu = None if lcu is None else torch.tensor(lcu, dtype=torch.int64, device=dev)
        o, fin = mixer.chunk(**x, scale=scale, initial_state=h0, output_final_state=True, cu_seqlens=lcu)
        return (o, fin.S, [fin.aux[n] for n in names]) if widths else (o, fin, [])

    def tokens(t0, t1):
        return {n: (t[:, t0:t1] if n in per_token else t) for n, t in given.items()}

    rest = None
    if n_head < S_rows.shape[0]:
        t0 = 0 if cu is None else me.cu[n_head]
        rest = run(tokens(t0, q.shape[1]), S_rows[n_head:], [a[n_head:] for a in aux_rows],
                   None if cu is None else [c - t0 for c in me.cu[n_head:]])
    # the head: a batch [B, T_r] or its one packed sequence as a batch of one
    head = tokens(0, q.shape[1] if cu is None else me.cu[1]) if me.from_left else None
    n_carry = B if cu is None else 1
    zero_S = torch.zeros(n_carry, HV, K, V, **f32)

    # ---- 1. the auxiliary states' maps, gathered and composed ----------------------------------
    aux_in, tied = [], []
    if widths:
        zero_aux = [torch.zeros(n_carry, HV, w, **f32) for w in widths]
        if carries and me.through:  # one call from the starts 0 and 1 (one value channel will do)
            l, r = aux_maps(mixer.ir, run, copies(head, 2, per_token), zero_aux,
                            [torch.ones_like(z) for z in zero_aux])
        elif carries:  # the carried sequence starts here: its outgoing state is rest's
            r, l = [a[-n_carry:] for a in rest[2]], zero_aux
        else:
            r, l = zero_aux, zero_aux
        maps = _gather(_tie(torch.cat([*l, *r], -1).float(), *leaves), group, grad)
        tied += maps
        if me.from_left:
            aux_in = list(torch.split(_compose(maps, sum(widths), every, rank, torch.mul), widths, -1))

    # ---- 2. this rank's map of the state: the head's final state is L S_in + R ---------------------
    wide = me.from_left and widens(mixer.ir)
    if wide:  # one run with K more value columns: [R | L] and the readout of S_in beside o
        E = torch.eye(K, **f32).expand(n_carry, HV, K, K)
        o_w, R_h, L_h, aux_h = wide_run(mixer.ir, run, head, zero_S, E, aux_in)
    if carries and me.through and wide:
        R, L = R_h, L_h
    elif carries and me.through:  # one run from 0 and from identity-like starts, as a batch
        R, L = fallback_maps(run, lambda c: copies(head, c, per_token), zero_S, aux_in)
    else:  # nothing to carry on, or the carried sequence starts here
        L = torch.zeros(n_carry, HV, K, K, **f32)
        R = rest[1][-n_carry:] if carries else zero_S

    # ---- 3. the maps of every rank, gathered and composed: the incoming state ------------------
    maps = _gather(_tie(torch.cat([L, R], -1).float(), *tied, *leaves), group, grad)  # after the aux gather
    tied += maps
    S = _compose(maps, K, every, rank, torch.matmul) if rank else None

    # ---- 4. the head from its true incoming state; the rest as it ran -------------------------
    parts = []
    if wide:  # o = o from 0 + (readout of the identity) S_in; final = R + L S_in
        parts.append((finish(o_w, V, S), R_h + L_h @ S, aux_h))
    elif me.from_left:
        parts.append(run(head, S, aux_in))
    if rest is not None:
        parts.append(rest)
    o = torch.cat([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
    o = _tie(o, *tied)
    if not output_final_state:
        return o, None
    fin = _tie(torch.cat([p[1] for p in parts]), *tied)
    if not widths:
        return o, fin
    aux = [torch.cat([p[2][i] for p in parts]) for i in range(len(widths))]
    return o, MixerState(fin, {a.name: t for a, t in zip(mixer.ir.aux, aux)})


def _compose(maps, n_l: int, every: list, rank: int, mul):
    """The state entering this rank from the gathered maps [world, ..., L | R] of the ranks before
    it, composed in rank order; a rank whose carried sequence starts on it (not `through`) cuts the
    composition."""
    starts = [not every[i].through for i in range(rank)]
    return prefix(maps[:rank, ..., :n_l], maps[:rank, ..., n_l:], mul, starts)[-1]
