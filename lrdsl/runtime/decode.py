"""Decoding from the API: Mixer.step's multi-token step over the recurrent kernel (the state updated
in place, the per-token states kept for a verifier), accept's roll-back, and the step of a readout of
the state before the update. Each takes the lrdsl.Mixer whose methods delegate here."""
from __future__ import annotations

import torch

from lrdsl.errors import InputError
from lrdsl.runtime import readouts
from lrdsl.runtime.tensors import MixerState, compute_dtype


def step(mixer, q, k, v, state, scale=None, out=None, return_states=False, states_out=None, **inputs):
    """Mixer.step (its docstring says what it does)."""
    if mixer.ir.solve_lam is not None:
        if return_states or states_out is not None or out is not None:
            raise InputError(f"mixer '{mixer.name}' reads its state through an offline solve, whose step "
                             "takes no out=, return_states= or states_out= yet: call step one token at a "
                             "time and keep copies of the state to roll back to")
        from lrdsl.runtime import offline
        return offline.step(mixer, q, k, v, state, scale, inputs)
    if mixer.ir.reads_before:
        return step_before(mixer, q, k, v, state, scale, inputs, out, return_states, states_out)
    if mixer.ir.steps:
        from lrdsl.runtime import product
        batch = mixer._validate(q, k, v, inputs, scale, state, True, None)
        buf = states_buffer(mixer, batch, states_out, v.device) if return_states or states_out is not None else None
        return product.step(mixer, batch, state, step_out(out, batch, v.dtype, v.device), return_states, buf)
    whole = state
    if isinstance(state, MixerState):
        state = state.S
    elif mixer.ir.aux and isinstance(state, torch.Tensor):
        names = ", ".join(a.name for a in mixer.ir.aux)
        raise InputError(f"mixer '{mixer.name}' has auxiliary states ({names}) that decoding must carry: "
                         "pass state=lrdsl.MixerState(S, {name: tensor}) (mixer.zero_state(...) to start, "
                         "or the final state of chunk(..., output_final_state=True))")
    if not isinstance(state, torch.Tensor):
        raise InputError("step() updates a state in place: pass state=, a contiguous float32 tensor "
                         f"[B, HV, K, V] (zeros to start), not {type(state).__name__}")
    batch = mixer._validate(q, k, v, inputs, scale, whole, True, None)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise InputError("step() updates the state in place: it must be a contiguous float32 tensor "
                         f"[B, HV, K, V], got {state.dtype}" + ("" if state.is_contiguous() else
                                                                ", not contiguous"))
    aux = list(batch.initial_aux or ())
    if any(a.dtype != torch.float32 or not a.is_contiguous() for a in aux):
        raise InputError("step() updates the auxiliary states in place: each must be a contiguous "
                         "float32 tensor")
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*batch.tensors.values(), state, *aux]):
        raise InputError("step() is the decode path and is forward-only; call it under torch.no_grad()")
    out = step_out(out, batch, v.dtype, v.device)
    every = states_buffer(mixer, batch, states_out, v.device) if (return_states or states_out is not None) else None
    S_all, aux_all = (every.S, [every.aux[a.name] for a in mixer.ir.aux]) if isinstance(every, MixerState) \
        else (every, None)
    tensors = {n: t.contiguous() for n, t in batch.tensors.items()}
    if not aux:
        o, _ = mixer.kernels.recurrent_fwd(tensors, batch.scale, state, True, None, final_state=state, out=out,
                                           all_states=S_all)
    elif aux_all is not None:  # the auxiliary states after the last token are in the per-token ones
        o, _ = mixer.kernels.recurrent_fwd(tensors, batch.scale, state, True, None, final_state=state,
                                           initial_aux=aux, out=out, all_states=S_all, all_aux=aux_all)
        for a, every_a in zip(aux, aux_all):
            a.copy_(every_a[:, -1])
    else:
        o, _, new = mixer.kernels.recurrent_fwd(tensors, batch.scale, state, True, None, final_state=state,
                                                initial_aux=aux, final_aux=True, out=out)
        for a, n in zip(aux, new):  # the K-wide states are read by every value tile: written after
            a.copy_(n)
    return (o, every) if return_states else o


def states_buffer(mixer, batch, given, device):
    """The per-token states' buffer of a multi-token step: `given` (checked) or a new one."""
    B, T, HV, K, V = batch.B, batch.T, batch.HV, batch.K, batch.V
    shapes = {"S": (B, T, HV, K, V), **{a.name: (B, T, HV, a.width(K, V)) for a in mixer.ir.aux}}
    if given is None:
        made = {n: torch.empty(shp, dtype=torch.float32, device=device) for n, shp in shapes.items()}
        return MixerState(made["S"], {a.name: made[a.name] for a in mixer.ir.aux}) if mixer.ir.aux else made["S"]
    parts = ({"S": given.S, **given.aux} if isinstance(given, MixerState) and isinstance(given.aux, dict)
             else {"S": given})
    want = "a MixerState of S [B, T, HV, K, V] and each auxiliary state [B, T, HV, K|V]" if mixer.ir.aux \
        else "a tensor [B, T, HV, K, V]"
    for n, shp in shapes.items():
        t = parts.get(n)
        if not (isinstance(t, torch.Tensor) and tuple(t.shape) == shp and t.dtype == torch.float32
                and t.is_contiguous() and t.device == device) or set(parts) != set(shapes):
            raise InputError(f"states_out must be {want} = {list(shapes['S'])}, contiguous float32 on "
                             f"{device}; got {describe(given)} (leave it out to get a new one)")
    return given


def accept(state, states, n) -> None:
    """Mixer.accept (its docstring says what it does)."""
    S_all = states.S if isinstance(states, MixerState) else states
    if not isinstance(S_all, torch.Tensor) or S_all.dim() != 5:
        raise InputError("accept() takes the states that step(..., return_states=True) returned "
                         f"([B, T, HV, K, V]), got {describe(states)}")
    B, T = S_all.shape[:2]
    if isinstance(n, int) and not isinstance(n, bool):
        if not 1 <= n <= T:
            raise InputError(f"accept() keeps n tokens of the {T} of the step, from 1 to {T}; got n={n}")
        index = None
    elif isinstance(n, torch.Tensor) and not n.is_floating_point() and tuple(n.shape) == (B,):
        index = (n.to(device=S_all.device, dtype=torch.int64) - 1).clamp(0, T - 1)
    else:
        raise InputError(f"accept() takes n as an int or a [B] = [{B}] integer tensor of counts, got "
                         f"{describe(n)}")
    pairs = [(state.S if isinstance(state, MixerState) else state, S_all)]
    if isinstance(states, MixerState):
        if not isinstance(state, MixerState):
            raise InputError("accept() got per-token auxiliary states but a plain state: pass the MixerState "
                             "that step() updated")
        pairs += [(state.aux[name], states.aux[name]) for name in states.aux]
    for dst, every in pairs:
        if index is None:
            dst.copy_(every[:, n - 1])
        else:  # a gather on the device: row b takes token n_b - 1
            at = index.view(B, 1, *[1] * (every.dim() - 2)).expand(B, 1, *every.shape[2:])
            dst.copy_(every.gather(1, at).squeeze(1))


def step_before(mixer, q, k, v, state, scale, inputs, out=None, return_states=False, states_out=None):
    """step of a readout with S_prev or dot-product terms: S_prev^T y of the first token is read
    from the state before any kernel updates it in place."""
    core, prev, shifted = mixer._parts
    part = core or prev
    batch = mixer._validate(q, k, v, inputs, scale, state, True, None)
    t = dict(batch.tensors)
    T = q.shape[1]
    o = every = None
    # the per-token states come from the part that updates `state` itself (both move S alike)
    keep = dict(return_states=True, states_out=states_out) if (return_states or states_out is not None) else {}
    out = step_out(out, batch, v.dtype, v.device)
    if prev is not None:
        S = state.S if isinstance(state, MixerState) else state
        if not isinstance(S, torch.Tensor):
            return part.step(q, k, v, state, scale, **inputs)  # its own clear error
        first = mixer._first(batch, t, S, None)
        if T == 1:
            o = first[:, None]
        else:
            snap = state if core is None else (
                MixerState(state.S.clone(), {n: a.clone() for n, a in state.aux.items()})
                if isinstance(state, MixerState) else state.clone())
            tp = dict(t, **{new: readouts.shift_next(t[old], None) for new, old in shifted.items()})
            tp = {n: x for n, x in tp.items() if n not in ("q", "k", "v")}
            o_p = prev.step(t["q"], t["k"], t["v"], snap, batch.scale, **tp, **({} if core else keep))
            o_p, every = o_p if (keep and not core) else (o_p, None)
            o = readouts.shift_back(o_p, first, None)
    if core is not None:
        rest = {n: x for n, x in t.items() if n not in ("q", "k", "v")}
        o_c = core.step(t["q"], t["k"], t["v"], state, batch.scale, **rest, **keep)
        o_c, every = o_c if keep else (o_c, None)
        o = o_c if o is None else o.to(o_c.dtype) + o_c
    elif T == 1:  # the state still moves on: the prev part's step (its output is not read)
        tp = {n: x for n, x in t.items() if n not in ("q", "k", "v")}
        tp.update({new: t[old] for new, old in shifted.items()})
        moved = prev.step(t["q"], t["k"], t["v"], state, batch.scale, **tp, **keep)
        every = moved[1] if keep else None
    extra = readouts.before_terms(mixer.ir, t, batch.H, batch.HV, batch.scale, compute_dtype(batch))
    o = (o.to(extra.dtype) + extra).to(v.dtype) if isinstance(extra, torch.Tensor) else o.to(v.dtype)
    if out is not None:
        out.copy_(o)
        o = out
    return (o, every) if return_states else o


def step_out(out, batch, dtype, device):
    """step's out= buffer, checked (None: the kernel makes one)."""
    if out is None:
        return None
    want = (batch.B, batch.T, batch.HV, batch.V)
    if not (isinstance(out, torch.Tensor) and tuple(out.shape) == want and out.dtype == dtype
            and out.is_contiguous() and out.device == device):
        raise InputError(f"out must be a contiguous {dtype} tensor [B, T, HV, V] = {list(want)} on {device} "
                         f"(v's dtype and device), got {describe(out)}")
    return out


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor {list(x.shape)} on {x.device}"
    return type(x).__name__
