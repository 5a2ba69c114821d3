"""The offline solve's chunked kernels as one torch.library custom op, for torch.compile.

Eager calls keep offline.ChunkFunction (its forward keeps the solutions and chunk states for the
backward). Under torch.compile a Python autograd.Function around host code that launches Triton
kernels breaks the graph, so there `offline.chunk` takes this op instead: an opaque forward with a
fake (meta) implementation, and a backward op that recomputes the forward's intermediates (a custom
op returns tensors only; what the eager path keeps would be a dozen of them).
"""
from __future__ import annotations

import torch

from lrdsl.runtime import nonfinite
from lrdsl.runtime.offline import host_inputs, state_in
from lrdsl.runtime.tensors import Batch

_OPS = {}


def offline_op(mixer, key: str):
    """The op of one generated module: op(tensors, S0, G0, aux0, scale, cu_seqlens, output_final_state)
    -> (o, S_T, G_T, the auxiliary final states side by side [N, HV, K|V + ...]); the finals are
    empty tensors unless output_final_state."""
    if key in _OPS:
        return _OPS[key]
    m, module = mixer.ir, mixer.kernels
    names = list(module.INPUTS)
    lib = f"lrdsl::{m.name}_{key}_offline"

    def widths_of(K, V):  # of the auxiliary states, side by side in the fourth output
        return [a.width(K, V) for a in m.aux]

    def sizes(tensors, cu_seqlens):
        q, v = tensors[names.index("q")], tensors[names.index("v")]
        B, T, H, K = q.shape
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        return B, T, H, v.shape[2], K, v.shape[3], N

    def batch_of(tensors, S0, G0, aux0, scale, cu_seqlens, output_final_state):
        # the Batch offline.chunk had validated, so its host helpers serve the op too
        B, T, H, HV, K, V, _ = sizes(tensors, cu_seqlens)
        return Batch(dict(zip(names, tensors)), B, T, H, HV, K, V, scale, S0, output_final_state,
                     cu_seqlens, initial_aux=tuple(aux0) if aux0 else None, initial_gram=G0)

    @torch.library.custom_op(lib + "_fwd", mutates_args=())
    def fwd(tensors: list[torch.Tensor], S0: torch.Tensor | None, G0: torch.Tensor | None,
            aux0: list[torch.Tensor], scale: float, cu_seqlens: torch.Tensor | None,
            output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = batch_of(tensors, S0, G0, aux0, scale, cu_seqlens, output_final_state)
        inputs, cu = host_inputs(mixer, batch)
        o, final = module.chunk_fwd(inputs, scale, state_in(m, batch), output_final_state, cu)
        if final is None:
            empty = o.new_empty(0, dtype=torch.float32)
            return o, empty, empty.clone(), empty.clone()
        aux = torch.cat(final[2], -1) if final[2] else o.new_empty(0, dtype=torch.float32)
        return o, final[0], final[1], aux

    @fwd.register_fake
    def _(tensors, S0, G0, aux0, scale, cu_seqlens, output_final_state):
        B, T, H, HV, K, V, N = sizes(tensors, cu_seqlens)
        v = tensors[names.index("v")]
        f32 = dict(dtype=torch.float32)
        if not output_final_state:
            return v.new_empty(B, T, HV, V), v.new_empty(0, **f32), v.new_empty(0, **f32), v.new_empty(0, **f32)
        width = sum(widths_of(K, V))
        return (v.new_empty(B, T, HV, V), v.new_empty(N, HV, K, V, **f32), v.new_empty(N, HV, K, K, **f32),
                v.new_empty((N, HV, width) if width else (0,), **f32))

    @torch.library.custom_op(lib + "_bwd", mutates_args=())
    def bwd(tensors: list[torch.Tensor], S0: torch.Tensor | None, G0: torch.Tensor | None,
            aux0: list[torch.Tensor], scale: float, cu_seqlens: torch.Tensor | None, do: torch.Tensor,
            dST: torch.Tensor | None, dGT: torch.Tensor | None, daux: torch.Tensor | None,
            needs: list[bool]) -> list[torch.Tensor]:
        from lrdsl.runtime.offline import input_grads
        masks = nonfinite.bad_entries(m, names, tensors)
        if masks is not None:  # the backward of the finite copies (runtime/nonfinite.py)
            tensors = nonfinite.finite_copies(m, names, tensors, masks)
        batch = batch_of(tensors, S0, G0, aux0, scale, cu_seqlens, False)
        inputs, cu = host_inputs(mixer, batch)
        dht = (None if dST is None else dST.contiguous(), None if dGT is None else dGT.contiguous())
        vgrads, dS0, dG0 = module.chunk_bwd(inputs, scale, state_in(m, batch), do.contiguous(), dht, cu)  # recomputes
        dfinal = torch.split(daux, widths_of(batch.K, batch.V), dim=-1) if daux is not None else ()
        grads, daux0 = input_grads(mixer, batch, inputs, list(tensors), needs, vgrads,
                                   list(aux0) if aux0 else None, dfinal)
        if masks is not None:
            grads = nonfinite.nan_at(grads, masks)
        out = [g if g is not None else t.new_empty(0) for g, t in zip(grads, tensors)]
        out += [dS0.to(S0.dtype) if S0 is not None else do.new_empty(0),
                dG0.to(G0.dtype) if G0 is not None else do.new_empty(0)]
        return out + [g.to(a.dtype) for g, a in zip(daux0, aux0)] if aux0 else out

    @bwd.register_fake
    def _(tensors, S0, G0, aux0, scale, cu_seqlens, do, dST, dGT, daux, needs):
        out = [torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(tensors, needs)]
        out += [torch.empty_like(S0) if S0 is not None else do.new_empty(0),
                torch.empty_like(G0) if G0 is not None else do.new_empty(0)]
        return out + [torch.empty_like(a) for a in aux0]

    def setup_context(ctx, inputs, output):
        tensors, S0, G0, aux0, scale, cu_seqlens, output_final_state = inputs
        starts = [t for t in (S0, G0) if t is not None]
        ctx.save_for_backward(*tensors, *starts, *aux0)
        ctx.meta = (len(tensors), S0 is not None, G0 is not None, len(aux0), scale, cu_seqlens,
                    output_final_state, output[0].shape)

    def backward(ctx, do, dST, dGT, daux):
        n, has_s, has_g, _, scale, cu_seqlens, output_final_state, o_shape = ctx.meta
        saved = list(ctx.saved_tensors)
        tensors = saved[:n]
        S0 = saved[n] if has_s else None
        G0 = saved[n + has_s] if has_g else None
        aux0 = saved[n + has_s + has_g:]
        needs = [t.requires_grad for t in tensors]
        if do is None:
            do = tensors[names.index("v")].new_zeros(o_shape)

        def given(d):  # the gradient of a final-state output, or None where there is none
            return d if (output_final_state and d is not None and d.numel()) else None
        res = bwd(tensors, S0, G0, aux0, scale, cu_seqlens, do, given(dST), given(dGT), given(daux), needs)
        grads = [g if need else None for g, need in zip(res[:n], needs)]
        dS0 = res[n] if has_s else None
        dG0 = res[n + 1] if has_g else None
        return grads, dS0, dG0, list(res[n + 2:]), None, None, None  # a list, empty without aux

    fwd.register_autograd(backward, setup_context=setup_context)
    _OPS[key] = fwd
    return fwd
