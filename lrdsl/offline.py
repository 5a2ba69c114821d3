"""The offline solve (Mesa) from the API: the whole state (S, the Gram state G and any auxiliary
states) in and out of the generated kernels, decoding in place, and the differentiable chunk.

The generated module (templates/mesa_*.py.jinja) takes states as tuples (S, G, [aux, ...]);
callers see lrdsl.MixerState(S, {"G": G, aux name: tensor, ...}).
"""
from __future__ import annotations

import torch

from .errors import InputError
from .tensors import MixerState


def zero_state(m, N, HV, K, V, device=None) -> MixerState:
    f32 = dict(dtype=torch.float32, device=device)
    aux = {a.name: torch.zeros(N, HV, K if a.kind == "K" else V, **f32) for a in m.aux}
    aux["G"] = torch.zeros(N, HV, K, K, **f32)
    return MixerState(torch.zeros(N, HV, K, V, **f32), aux)


def state_in(m, batch) -> tuple | None:
    """(S, G, [aux, ...]) in fp32 to start from, zeros for the parts not given; None for none."""
    if batch.initial_state is None and batch.initial_gram is None and batch.initial_aux is None:
        return None
    N, HV, K, V = batch.N, batch.HV, batch.K, batch.V
    f32 = dict(dtype=torch.float32, device=batch.tensors["q"].device)

    def part(t, *shape):
        return torch.zeros(*shape, **f32) if t is None else t.to(torch.float32).contiguous()

    aux = batch.initial_aux if batch.initial_aux is not None else [None] * len(m.aux)
    return (part(batch.initial_state, N, HV, K, V), part(batch.initial_gram, N, HV, K, K),
            [part(t, N, HV, K if a.kind == "K" else V) for a, t in zip(m.aux, aux)])


def state_out(m, S, G, aux) -> MixerState:
    parts = {a.name: t for a, t in zip(m.aux, aux)}
    parts["G"] = G
    return MixerState(S, parts)


def host_inputs(mixer, batch):
    """The tensors the generated module takes (its INPUTS, by name, contiguous) and cu_seqlens."""
    inputs = {n: batch.tensors[n].contiguous() for n in mixer.kernels.INPUTS}
    cu = batch.cu_seqlens.to(torch.int64).contiguous() if batch.cu_seqlens is not None else None
    return inputs, cu


def recurrent(mixer, batch):
    """mixer.recurrent for an offline-solve mixer: (o, MixerState or None)."""
    m = mixer.ir
    inputs, cu = host_inputs(mixer, batch)
    o, final = mixer.kernels.recurrent_fwd(inputs, batch.scale, state_in(m, batch), batch.output_final_state, cu)
    return o, (state_out(m, *final) if batch.output_final_state else None)


def step(mixer, q, k, v, state, scale, inputs):
    """mixer.step for an offline-solve mixer: decodes the given tokens and updates the whole state
    (a MixerState of float32 contiguous tensors) in place."""
    m = mixer.ir
    if not isinstance(state, MixerState):
        raise InputError(f"mixer '{m.name}' reads its state through an offline solve, whose Gram state "
                         "decoding must carry: pass state=lrdsl.MixerState(S, {\"G\": G, ...}) "
                         "(mixer.zero_state(...) to start, or the final state of chunk(..., output_final_state=True))")
    batch = mixer._validate(q, k, v, inputs, scale, state, True, None)
    parts = [batch.initial_state, batch.initial_gram, *(batch.initial_aux or ())]
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in parts):
        raise InputError("step() updates the state in place: S, G and every auxiliary state must be contiguous "
                         "float32 tensors")
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*batch.tensors.values(), *parts]):
        raise InputError("step() is the decode path and is forward-only; call it under torch.no_grad()")
    inputs, _ = host_inputs(mixer, batch)
    S, G, aux = parts[0], parts[1], list(parts[2:])
    new = (S, torch.empty_like(G), [torch.empty_like(a) for a in aux])  # S in place: tiles are read first
    o, _ = mixer.kernels.recurrent_fwd(inputs, batch.scale, (S, G, aux), True, None, final=new)
    G.copy_(new[1])  # the Gram and auxiliary states are read whole by every value tile: written after
    for a, n in zip(aux, new[2]):
        a.copy_(n)
    return o
