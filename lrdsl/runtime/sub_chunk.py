"""The staged chunk of a mixer whose kernels read sub-tokens in place (plan.sub_tokens: a product's
direct sub-mixer, runtime/product.py; the split's spec, runtime/split.py) on the caller's tensors,
forward and backward as one autograd Function. The kernels store o and read dO at each token's last
sub-token alone (plan.sub_out); `pick` maps the chain rule's gradients to the caller's tensors."""
from __future__ import annotations

import torch

from lrdsl.runtime import nonfinite
from lrdsl.runtime.autograd import finite_states, reads_inputs


class SubTokenChunk(torch.autograd.Function):
    """apply(part, pick, names, checked, scale, cu, output_final_state, h0, *tensors) -> (o, final):
    part has .kernels and .ir (the sub-token mixer's), names the kernels' name of each tensor,
    checked the name the non-finite rule knows it by ("" for none), pick(g, name) its gradient from
    the chain rule's g (None for none)."""

    @staticmethod
    def forward(ctx, part, pick, names, checked, scale, cu, output_final_state, h0, *tensors):
        h0c = h0.to(torch.float32).contiguous() if h0 is not None else None
        r = part.kernels.chunk_fwd(dict(zip(names, tensors)), scale, h0c, output_final_state, cu)
        ctx.save_for_backward(*tensors)
        ctx.info = (part, pick, names, checked, scale, cu, h0c, None if h0 is None else h0.dtype, r.residual,
                    (r.o.shape, r.o.dtype))
        ctx.set_materialize_grads(False)
        return r.o, r.final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        part, pick, names, checked, scale, cu, h0, h0_dtype, residual, (o_shape, o_dtype) = ctx.info
        module, sub = part.kernels, part.ir
        tensors = list(ctx.saved_tensors)
        if do is None:
            do = torch.zeros(o_shape, dtype=o_dtype, device=tensors[0].device)
        # nan at each bad entry (runtime/nonfinite.py's device mode): the kernels read the inputs
        # and make them finite as they load them (codegen/finite.py), else run on finite copies; the
        # residual is this backward's alone: zeroed in place where an input is bad
        st = None
        if reads_inputs(sub, module, tensors[names.index("q")].shape[-1], None):
            inputs = dict(zip(names, tensors))
            st, bad = finite_states(sub, module, inputs, checked, scale, h0, cu, None, residual)
        else:
            finite, bad = nonfinite.device_copies(sub, checked, tensors)
            flag = nonfinite.any_flag(bad)
            if residual is not None and flag is not None:
                residual = nonfinite.zero_nonfinite_(residual, flag)
            inputs = dict(zip(names, finite))
        vgrads, dh0 = module.chunk_bwd(inputs, scale, h0, do, dht, cu, st, residual)
        g = module.chain_rule(inputs, scale, vgrads)
        grads = nonfinite.device_nan_at(sub, checked, tensors, [pick(g, x) for x in names], bad)
        grads = [gr if need else None for gr, need in zip(grads, ctx.needs_input_grad[8:])]
        dh0 = dh0.to(h0_dtype) if dh0 is not None and ctx.needs_input_grad[7] else None
        return (None,) * 7 + (dh0, *grads)


def run(part, pick, batch, n: int, route):
    """chunk of the caller's batch through part's kernels on a sub-token route (names, checked,
    tensors), n sub-tokens per token: (o [B, T, HV, V], the final state or None)."""
    names, checked, tensors = route
    scale = batch.scale if batch.scale is not None else batch.K ** -0.5
    cu = None if batch.cu_seqlens is None else (batch.cu_seqlens * n).to(torch.int64).contiguous()
    return SubTokenChunk.apply(part, pick, names, checked, float(scale), cu, batch.output_final_state,
                               batch.initial_state, *tensors)
