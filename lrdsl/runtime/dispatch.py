"""The routes of Mixer.chunk past its value sides, segments, offline solve and readout parts: the
native staged forward of a decay after the erase, the split spec's staged kernels, and the chunked
kernels through autograd.ChunkFunction or the custom op. Each takes the lrdsl.Mixer that chunk runs."""
from __future__ import annotations

import os


def native_rank2(mixer, batch) -> bool:
    """The native staged forward of a decay after the erase (plan.rank2, staged_rank2.py.jinja)
    serves this call: asked for (LRDSL_NATIVE_RANK2=1: on the H200 it holds half the split's
    forward memory but takes 1.18x its time, measured 2026-12-03, e67cbe5), no gradient asked for (the
    backward keeps the split), keys within the staged limit, every input and the initial state
    finite but for resets (-inf in the log-decay, floored there as on every path). A non-finite
    entry takes the split, whose kernels keep it causal; the check is one wait for the device,
    so not under torch.compile or torch.func transforms (autograd.eager)."""
    k = mixer.kernels
    if os.environ.get("LRDSL_NATIVE_RANK2") != "1" or not hasattr(k, "rank2_fwd") or batch.K > k.STAGED_MAX_K:
        return False
    import torch

    from lrdsl.runtime.autograd import eager
    tensors = [*batch.tensors.values(), *([] if batch.initial_state is None else [batch.initial_state])]
    if (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)) or not eager(tensors):
        return False
    resets = [batch.tensors[n] for n in k.RANK2_RESETS]
    finite = [torch.isfinite(t).all() for t in tensors if not any(t is r for r in resets)]
    finite += [(~t.isnan() & (t < float("inf"))).all() for t in resets]  # -inf: a reset, floored
    return bool(torch.stack(finite).all())


def chunk_rank2(mixer, batch):
    from lrdsl.runtime.autograd import host_args
    names = list(mixer.ir.tensor_names)
    inputs, h0, cu = host_args(names, [batch.tensors[n] for n in names], batch.initial_state, batch.cu_seqlens)
    return mixer.kernels.rank2_fwd(inputs, batch.scale, h0, bool(batch.output_final_state), cu)


def chunk_split(mixer, batch):
    """The split's staged kernels: on the call's own tensors where runtime/split.py's in_place takes
    the call, else on [B, 2T, ...] interleaved copies (each token twice, the phase beside them)."""
    from lrdsl.runtime import split
    route = split.in_place(mixer, batch)
    if route is not None:
        return split.run(mixer, batch, route)
    from lrdsl.codegen.split import interleave, phases
    params = {p.name for p in mixer.ir.params}
    t = {n: x if n in params else interleave(x) for n, x in batch.tensors.items()}
    q, k, v = t.pop("q"), t.pop("k"), t.pop("v")
    t[mixer.split.ir.inputs[-1].name] = phases(batch.B, batch.T, batch.H, q)
    cu = None if batch.cu_seqlens is None else 2 * batch.cu_seqlens
    o, final = mixer.split.chunk(q, k, v, batch.scale, batch.initial_state, batch.output_final_state, cu,
                                 segments=1, **t)
    return o[:, 1::2].contiguous(), final


def final(mixer, batch, S, aux):
    """What chunk returns as the final state: None, S, or the whole state."""
    if not batch.output_final_state:
        return None
    return mixer._state_out(S, aux) if mixer.ir.aux else S


def chunk_eager(mixer, batch, tensors):
    """chunk through autograd.ChunkFunction: from auxiliary initial states, keeping the
    forward's intermediates, or outside torch.compile (autograd.eager: less host time than the
    custom op). Differentiable in every input, S0 and each auxiliary initial state."""
    import torch

    from lrdsl.runtime import autograd
    aux0 = list(batch.initial_aux or ())
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                            for t in (*tensors, batch.initial_state, *aux0))):
        # nothing to differentiate: ChunkFunction.forward's kernels without the Function
        r, _, _ = autograd.chunk_forward(mixer.kernels, batch, list(mixer.ir.tensor_names),
                                         mixer.keep_intermediates, tensors, batch.initial_state, aux0)
        return r.o, final(mixer, batch, r.final_state, r.final_aux)
    o, ht, *finals = autograd.ChunkFunction.apply(
        mixer.ir, mixer.kernels, batch, list(mixer.ir.tensor_names), mixer.keep_intermediates,
        batch.initial_state, len(aux0), *tensors, *aux0)
    return o, final(mixer, batch, ht, finals)


def chunk_tensors(mixer, batch, tensors):
    """The differentiable chunk as one custom op (torch.compile sees no graph break)."""
    import torch
    o, ht, _, aux = mixer.chunk_op(tensors, batch.initial_state, batch.scale, batch.cu_seqlens,
                                   bool(batch.output_final_state))
    widths = [a.width(batch.K, batch.V) for a in mixer.ir.aux]
    finals = torch.split(aux, widths, dim=-1) if batch.output_final_state and widths else ()
    return o, final(mixer, batch, ht, finals)
