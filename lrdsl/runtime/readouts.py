"""Readouts with S_prev^T y and dot-product terms (codegen/readouts.py): the parts' kernels, the
shift of one token, the first token's readout of the initial state and the dot products, all as
differentiable torch operations around the kernels (no host synchronisation)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from lrdsl.runtime.reference import prepare_inputs, to_torch


def shift_next(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """x [B, T, ...] with each token holding the next token's value; the last token of each
    sequence keeps its own (any in-range value will do: the output read there is dropped)."""
    T = x.shape[1]
    idx = torch.arange(1, T + 2, device=x.device)  # one slot past the end, for empty sequences
    if cu_seqlens is not None:
        cu = cu_seqlens.long()
        # an empty sequence has no last token (at offset 0, cu - 1 would be -1): it writes the spare slot
        last = torch.where(cu[1:] > cu[:-1], cu[1:] - 1, torch.full_like(cu[1:], T))
        idx = idx.scatter(0, last, last)
    # the clamp keeps the batch's last token at its own: no index written from the host, which in a
    # CUDA graph's capture is a refused host-to-device copy
    return x.index_select(1, idx[:T].clamp(max=max(T - 1, 0)))


def shift_back(o: torch.Tensor, first: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """o [B, T, HV, V] moved one token later within each sequence; the first token of each sequence
    gets first [B or N, HV, V]."""
    if cu_seqlens is None:
        return torch.cat([first[:, None].to(o.dtype), o[:, :-1]], 1)
    T = o.shape[1]
    t = torch.arange(T, device=o.device)
    seq = torch.searchsorted(cu_seqlens.long(), t, right=True) - 1  # the sequence of each token
    is_first = t == cu_seqlens.long()[seq]
    moved = o.index_select(1, (t - 1).clamp(min=0))
    return torch.where(is_first[None, :, None, None], first[seq][None].to(o.dtype), moved)


def env_of(m, tensors: dict, H: int, HV: int, dtype: torch.dtype, exprs=()) -> dict:
    """The inputs (prepared as the reference prepares them: clamped, normalised, repeated over value
    heads), params and lets that exprs read (with the lets inlined), and the head index h, for all
    tokens at once: [B, T, HV, K|V|1]. Only those: each is a pass over a [B, T, HV, K] tensor."""
    q = tensors["q"]
    used = {s.name for e in exprs for s in m.inline_lets(e).free_symbols}
    sub = dataclasses.replace(m, inputs=tuple(i for i in m.inputs if i.name in used),
                              params=tuple(p for p in m.params if p.name in used))
    b = SimpleNamespace(tensors=tensors, B=q.shape[0], T=q.shape[1], H=H, HV=HV)
    env = prepare_inputs(sub, b, dtype)
    env["h"] = torch.arange(HV, device=q.device, dtype=dtype).view(1, 1, HV, 1)
    for lt in m.lets:  # in order; a let that reads an input exprs do not need is not needed itself
        if {s.name for s in lt.expr.free_symbols} <= set(env):
            env[lt.name] = to_torch(lt.expr)(env)
    return env


def before_terms(m, tensors: dict, H: int, HV: int, scale: float, dtype) -> torch.Tensor | float:
    """scale * sum of (x^T y) z over the dot-product terms, [B, T, HV, V]."""
    if not m.bonus:
        return 0.0
    env = env_of(m, tensors, H, HV, dtype, [e for bn in m.bonus for e in (bn.summand, bn.value)])
    out = 0.0
    for bn in m.bonus:
        dot = torch.as_tensor(to_torch(bn.summand)(env)).sum(-1, keepdim=True)
        out = out + dot * to_torch(bn.value)(env)
    return out * scale


def first_readout(m, tensors: dict, H: int, HV: int, scale: float, S0, cu_seqlens, dtype):
    """S0^T (scale * y) at the first token of each sequence, [B or N, HV, V] (zeros without S0)."""
    starts = (torch.zeros(1, dtype=torch.long, device=tensors["q"].device) if cu_seqlens is None
              else cu_seqlens[:-1].long().clamp(max=max(tensors["q"].shape[1] - 1, 0)))
    firsts = {n: (t.index_select(1, starts) if t.dim() >= 3 and n not in {p.name for p in m.params} else t)
              for n, t in tensors.items()}
    env = env_of(m, firsts, H, HV, dtype, [m.query_prev])
    y = torch.as_tensor(to_torch(m.inline_lets(m.query_prev))(env)) * scale  # [B, 1 or N, HV, K]
    y = y[:, 0] if cu_seqlens is None else y[0]
    y = y.expand(*y.shape[:-1], S0.shape[-2]) if y.shape[-1] == 1 else y
    return torch.einsum("nhk,nhkv->nhv", y.to(dtype), S0.to(dtype))
