"""Run a product of n steps per token (codegen/product.py) on its sub-mixer's kernels: every
per-token quantity of step j becomes sub-token n t + j of a sequence n times longer, the decay
sits on the first sub-token of each token (log-decay 0 on the others), the query on the last
(zero on the others), and o is read at the last. All of it differentiable torch operations around
the sub-mixer's calls, so chunk's backward is the sub-mixer's, through the gather."""
from __future__ import annotations

import torch

from lrdsl.codegen import product as cp
from lrdsl.frontend import ir
from lrdsl.runtime.readouts import env_of
from lrdsl.runtime.reference import to_torch


def interleave(xs: list) -> torch.Tensor:
    """[B, T, ...] tensors x_0 .. x_{n-1} -> [B, n T, ...]: x_j at sub-token n t + j."""
    B, T = xs[0].shape[:2]
    return torch.stack(xs, 2).reshape(B, len(xs) * T, *xs[0].shape[2:])


def sub_inputs(m: ir.Mixer, tensors: dict, H: int, HV: int, sub: ir.Mixer) -> dict:
    """The sub-mixer's inputs [B, n T, HV, ...] from the spec's inputs and params: the per-step
    vectors in the compute dtype (inputs clamped and normalised as on every path), cast to q's
    dtype; the log-decay in float32 (float64 for float64 inputs)."""
    q = tensors["q"]
    low = torch.float64 if q.dtype == torch.float64 else torch.float32
    steps = cp.steps_of(m)
    query = m.inline_lets(m.query)
    exprs = [query, *(e for s in steps for e in s)]
    if m.decay.kind != "identity":
        exprs.append(m.log_decay())
    env = env_of(m, tensors, H, HV, low, exprs)
    B, T = q.shape[:2]
    K, V = q.shape[-1], tensors["v"].shape[-1]
    shape = {"K": (B, T, HV, K), "V": (B, T, HV, V), "scalar": (B, T, HV, 1)}

    def ev(e, kind):
        x = torch.as_tensor(to_torch(e)(env), dtype=low, device=q.device)
        return x.expand(shape[kind])

    zero_k = torch.zeros(shape["K"], dtype=low, device=q.device)
    out = {cp.Q: interleave([zero_k] * (len(steps) - 1) + [ev(query, "K")]),
           cp.C: interleave([ev(c, "K") for _, c, _, _ in steps]),
           cp.Z: interleave([ev(z, "V") for _, _, _, z in steps]),
           cp.A: interleave([ev(a, "K") for a, _, _, _ in steps])}
    if any(i.name == cp.U for i in sub.inputs):
        out[cp.U] = interleave([ev(u, "K") for _, _, u, _ in steps])
    out = {n: x.to(q.dtype) for n, x in out.items()}
    if m.decay.kind != "identity":
        kind = "K" if m.decay.kind == "diagonal" else "scalar"
        g = ev(m.log_decay(), kind)
        g = interleave([g] + [torch.zeros_like(g)] * (len(steps) - 1))
        out[cp.G] = g if kind == "K" else g[..., 0]
    return out


def times(cu, n: int):
    return None if cu is None else cu * n


def last(o: torch.Tensor, n: int) -> torch.Tensor:
    """The sub-mixer's o [B, n T, HV, V] at the last sub-token of each token."""
    return o[:, n - 1::n]


def run(mixer, method: str, batch, cp_group=None, offsets=None):
    """chunk or recurrent of a product mixer through its sub-mixer."""
    sub, n = mixer.product, mixer.ir.n_steps
    x = sub_inputs(mixer.ir, batch.tensors, batch.H, batch.HV, sub.ir)
    q, k, v = x.pop(cp.Q), x.pop(cp.C), x.pop(cp.Z)
    opts = dict(scale=batch.scale, initial_state=batch.initial_state, output_final_state=batch.output_final_state,
                cu_seqlens=times(batch.cu_seqlens, n))
    if cp_group is not None:
        opts["cp_group"] = cp_group
    if offsets is not None:
        opts["cu_seqlens_cpu"] = [n * int(c) for c in offsets]
    o, final = getattr(sub, method)(q, k, v, **opts, **x)
    return last(o, n).contiguous(), final


def step(mixer, batch, state):
    """Decode: the sub-mixer's step over n sub-tokens per token, the state updated in place."""
    sub, n = mixer.product, mixer.ir.n_steps
    x = sub_inputs(mixer.ir, batch.tensors, batch.H, batch.HV, sub.ir)
    q, k, v = x.pop(cp.Q), x.pop(cp.C), x.pop(cp.Z)
    o = sub.step(q, k, v, state, batch.scale, **x)
    return last(o, n).contiguous()
