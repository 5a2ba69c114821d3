"""The split's chunk (codegen/split.py) on the spec's own [B, T, ...] tensors: its staged kernels read
both sub-tokens of token t at row t of every input (plan.sub_reads) and the phase from a constant
[2, H] tensor with token stride 0 (plan.sub_steps), store o and read dO at phase 1's rows alone
(plan.sub_out), and the chain rule stores each sub-token's input gradients, which one torch sum adds
per token (chain_rule.py.jinja's _chain_sums). No [B, 2T, ...] copy of an input, of o or of dO."""
from __future__ import annotations

import torch

from lrdsl.runtime import nonfinite
from lrdsl.runtime.autograd import eager
from lrdsl.runtime.product import _rows


def in_place(mixer, batch):
    """(names, names for the non-finite checks, tensors) for the split's kernels on the call's
    tensors, or None where chunk takes the interleaved copies (dispatch.chunk_split): a split plan
    without the sub-token holes (codegen/split.py's with_sub_tokens), keys past the staged kernels,
    keep_intermediates (what the forward keeps is the backward's, which reads the interleaved
    rows' offsets of its own copies), torch.compile or another transform or mode (the custom op's
    path) and the non-finite checks' host mode."""
    split = mixer.split
    module = split.kernels
    if not getattr(module, "SUB_TOKENS", 0) or batch.K > module.STAGED_MAX_K or mixer.keep_intermediates:
        return None
    t = batch.tensors
    if nonfinite.MODE != "device" or not eager(list(t.values())):
        return None
    params = {p.name for p in mixer.ir.params}
    names = list(t)
    # each token's heads (and channels) contiguous, tokens any distance apart (product._rows)
    tensors = [x if n in params else _rows(x) if x.dim() == 4 else _rows(x[..., None])[..., 0] for n, x in t.items()]
    phase = split.ir.split_phase
    q = t["q"]
    # phase j of every token and head: row j of this [2, H] tensor, read with token stride 0 (set
    # here: expand gives a dimension of size 1, T = 1, stride 1, which the kernels would read)
    steps = torch.arange(2, device=q.device, dtype=q.dtype)[:, None].expand(2, batch.H).contiguous()
    names += [phase, phase + ":1"]
    tensors += [steps.as_strided((batch.B, batch.T, batch.H), (0, 0, 1), j * batch.H) for j in range(2)]
    # the phase is no input of the caller's: never checked, never differentiated
    checked = [n if n not in (phase, phase + ":1") else "" for n in names]
    return names, checked, tensors


class _SplitChunk(torch.autograd.Function):
    """The split mixer's staged chunk on in_place's tensors, forward and backward."""

    @staticmethod
    def forward(ctx, mixer, names, checked, scale, cu, output_final_state, h0, *tensors):
        module = mixer.split.kernels
        h0c = h0.to(torch.float32).contiguous() if h0 is not None else None
        r = module.chunk_fwd(dict(zip(names, tensors)), scale, h0c, output_final_state, cu)
        ctx.save_for_backward(*tensors)
        ctx.info = (mixer, names, checked, scale, cu, h0c, None if h0 is None else h0.dtype, r.residual)
        ctx.set_materialize_grads(False)
        return r.o, r.final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        mixer, names, checked, scale, cu, h0, h0_dtype, residual = ctx.info
        module, sub = mixer.split.kernels, mixer.split.ir
        tensors = list(ctx.saved_tensors)
        if do is None:
            do = torch.zeros_like(tensors[names.index("v")])
        # the backward on finite copies of the T-token inputs, nan at each bad entry
        # (runtime/nonfinite.py's device mode); the residual is this backward's alone
        finite, bad = nonfinite.device_copies(sub, checked, tensors)
        flags = [f for f in bad if f is not None]
        if residual is not None and flags:
            residual = nonfinite.zero_nonfinite_(residual, torch.stack(flags).amax())
        inputs = dict(zip(names, finite))
        vgrads, dh0 = module.chunk_bwd(inputs, scale, h0, do, dht, cu, None, residual)
        g = module.chain_rule(inputs, scale, vgrads)
        phase = sub.split_phase
        grads = [None if n.split(":")[0] == phase else g[n] for n in names]
        grads = nonfinite.device_nan_at(sub, checked, tensors, grads, bad)
        grads = [gr if need else None for gr, need in zip(grads, ctx.needs_input_grad[7:])]
        dh0 = dh0.to(h0_dtype) if dh0 is not None and ctx.needs_input_grad[6] else None
        return (None, None, None, None, None, None, dh0, *grads)


def run(mixer, batch, route):
    """chunk through the split on in_place's route: (o [B, T, HV, V], the final state or None)."""
    names, checked, tensors = route
    scale = batch.scale if batch.scale is not None else batch.K ** -0.5
    cu = None if batch.cu_seqlens is None else (batch.cu_seqlens * 2).to(torch.int64).contiguous()
    return _SplitChunk.apply(mixer, names, checked, float(scale), cu, batch.output_final_state,
                             batch.initial_state, *tensors)
