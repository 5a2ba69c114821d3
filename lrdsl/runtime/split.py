"""The split's chunk (codegen/split.py) on the spec's own [B, T, ...] tensors: its staged kernels read
both sub-tokens of token t at row t of every input (plan.sub_reads) and the phase from a constant
[2, H] tensor with token stride 0 (plan.sub_steps), store o and read dO at phase 1's rows alone
(plan.sub_out), and the chain rule stores each sub-token's input gradients, which one torch sum adds
per token (chain_rule.py.jinja's _chain_sums). No [B, 2T, ...] copy of an input, of o or of dO."""
from __future__ import annotations

import torch

from lrdsl.runtime import nonfinite, sub_chunk
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


def run(mixer, batch, route):
    """chunk through the split on in_place's route: (o [B, T, HV, V], the final state or None)."""
    phase = mixer.split.ir.split_phase

    def pick(g, x):  # the phase is no input of the caller's: no gradient
        return None if x.split(":")[0] == phase else g[x]
    return sub_chunk.run(mixer.split, pick, batch, 2, route)
